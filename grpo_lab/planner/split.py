"""One GPU split between a vLLM engine and the learner: what a gpu_memory_utilization leaves vLLM (its weights, its
working memory, KV-cache tokens, full-length sequences), and the largest share that leaves the learner's planned
peak room (`generator.gpu_memory_utilization: auto`).

vLLM's share is a budget of share x GPU for its weights, working memory and KV cache; the KV cache is what is left
after the other two, and vLLM refuses to start when it cannot hold one sequence of max_model_len tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..models.shapes import ModelShape
from .estimate import CUDA_CONTEXT, DTYPE_BYTES, VLLM_SPLIT_SHARE, GiB

# why 5%: auto leaves this much of the GPU to nobody: the caching allocator's fragmentation and the planner's own
# error (bench/plan_accuracy/planner_accuracy.py) must not push a planned fit over the edge
AUTO_MARGIN = 0.05
ENGINE_GRAPHS = 0.5 * GiB  # CUDA graphs of the decode batch sizes vLLM captures (not measured: no GPU lent so far)


def vllm_defaults(capacity: float) -> tuple[int, int]:
    """vLLM's offline defaults (max_num_batched_tokens, max_num_seqs), which it picks by GPU memory (EngineArgs)."""
    return (16384, 1024) if capacity >= 70 * GiB else (8192, 256)


def engine_work_bytes(shape: ModelShape, config, capacity: float, tp: int = 1) -> float:
    """vLLM's memory beside weights and KV cache, per GPU: its profiling forward of max_num_batched_tokens tokens (one
    layer's intermediates at a time, no graph; tensor parallel splits them), the sampler's float32 logits, log-probs
    and probabilities for max_num_seqs rows, and its CUDA graphs. This is also what it keeps asleep (sleep frees
    weights and KV cache only)."""
    tokens, seqs = vllm_defaults(capacity)
    e = DTYPE_BYTES[config.model.dtype]
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    forward = tokens * (2 * shape.hidden + (q + 2 * kv + 3 * shape.intermediate) / tp) * e
    return forward + 3 * seqs * shape.vocab * 4 + ENGINE_GRAPHS


def kv_token_bytes(shape: ModelShape, config, tp: int = 1) -> float:
    """One token's K and V over every layer, per GPU (tensor parallel splits the KV heads)."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * DTYPE_BYTES[config.model.dtype] / tp


@dataclass
class Split:
    """The split of one GPU: vLLM's share (None: auto found none), what it holds, and what the learner needs."""

    device: str
    capacity: float
    share: Optional[float]
    auto: bool
    weights: float  # vLLM's weights on this GPU (its tensor-parallel shard)
    work: float  # its working memory (engine_work_bytes)
    token_bytes: float  # one KV token on this GPU
    sequence: int  # max_prompt_length + max_completion_length: vLLM's max_model_len
    learner: float  # the learner's planned peak beside the awake engine on this GPU (0 on a GPU of its own)
    learner_phase: Optional[str]
    sleeps: bool
    largest: float  # the largest share the learner leaves (before rounding and the 0.9 cap)

    @property
    def minimum(self) -> float:
        """The smallest share vLLM starts with: its weights, working memory and one full-length sequence."""
        return (CUDA_CONTEXT + self.weights + self.work + self.sequence * self.token_bytes) / self.capacity

    @property
    def kv_bytes(self) -> float:
        return max((self.share or 0) * self.capacity - CUDA_CONTEXT - self.weights - self.work, 0.0)

    @property
    def kv_tokens(self) -> int:
        return int(self.kv_bytes // self.token_bytes)

    @property
    def sequences(self) -> int:
        return self.kv_tokens // self.sequence

    @property
    def feasible(self) -> bool:
        return self.share is not None and self.sequences >= 1

    def describe(self) -> str:
        """The split in one line, as the plan prints it."""
        who = "auto" if self.auto else "set"
        beside = (
            f"; beside the learner's {self.learner / GiB:.2f} GiB peak ({self.learner_phase}"
            f"{', vLLM asleep then' if self.sleeps and self.learner_phase != 'rollout' else ''})"
            if self.learner
            else ""
        )
        if not self.feasible:
            left = (
                f"the learner's {self.learner / GiB:.2f} GiB peak ({self.learner_phase}) with "
                f"{AUTO_MARGIN:.0%} left free leaves {max(self.largest, 0):.2f}"
                if self.auto
                else f"it has {self.share}"
            )
            return (
                f"{self.device}: no share of its {self.capacity / GiB:.1f} GiB holds vLLM: it needs "
                f"{self.minimum:.2f} (weights {self.weights / GiB:.2f} GiB, working memory {self.work / GiB:.2f} GiB, "
                f"one {self.sequence}-token sequence), and {left}"
            )
        plural = "s" if self.sequences != 1 else ""
        return (
            f"{self.device}: vLLM {self.share:.2f} ({who}) = {self.share * self.capacity / GiB:.2f} GiB: weights "
            f"{self.weights / GiB:.2f}, working memory {self.work / GiB:.2f}, KV cache {self.kv_bytes / GiB:.2f} GiB "
            f"= {self.kv_tokens:,} tokens = {self.sequences:,} sequence{plural} of {self.sequence}{beside}"
            + (f"; {AUTO_MARGIN:.0%} of the GPU left free" if self.auto and self.learner else "")
        )


def largest_share(device, capacity: float, work: float, sleeps: bool) -> tuple[float, float, Optional[str]]:
    """(largest share, the learner's binding peak, its phase) on `device` (a DevicePlan holding the learner's items,
    the engine's not yet): awake, the engine's share sits beside the learner's heaviest phase; with sleep mode only
    beside the rollout, and the other phases must fit beside what it keeps asleep (its working memory)."""
    margin = AUTO_MARGIN * capacity
    phases = [p for p in ("rollout", "logprobs", "backward") if any(i.phase == p for i in device.items)]
    if not sleeps:
        phase = device.peak_phase
        peak = device.total
    else:
        phase, peak = "rollout", device.phase_peak("rollout")
        asleep = max((device.phase_peak(p) for p in phases if p != "rollout"), default=device.resident)
        if asleep + work > capacity - margin:  # the learner's phases do not fit even beside a sleeping engine
            return -1.0, asleep, max((p for p in phases if p != "rollout"), key=device.phase_peak, default=None)
    # why + CUDA_CONTEXT: the engine's share includes a CUDA context, which the device's plan holds once already
    return (capacity - margin - peak + CUDA_CONTEXT) / capacity, peak, phase


def auto_share(largest: list[float]) -> Optional[float]:
    """Auto's share for every GPU of the engine (vLLM takes one share on all of them): the smallest largest share,
    rounded down to 0.01, at most vLLM's own default of 0.9; None when a GPU leaves none."""
    share = min(math.floor(min(largest) * 100) / 100, VLLM_SPLIT_SHARE)
    return share if share > 0 else None
