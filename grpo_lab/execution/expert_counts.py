"""How many 4-bit experts a phase dequantized (models/routed_experts.py counts them per experts module): the rollout's
forwards, and the learner's backward (its forwards, their recomputes under gradient checkpointing, and what the
experts' backward dequantizes again), for the step's metrics. 0 for a model without 4-bit experts. A phase's end drops
the experts a small model held for it (models/held_experts.py). Both read the experts modules found once a model
(models/experts_found.py): a dense model's phase walks none of its modules."""

from __future__ import annotations

from typing import Callable

from ..models.held_experts import release
from ..models.routed_experts import experts_dequantized


def counted(phase: Callable, set_count: Callable) -> Callable:
    """`phase(ex, state, *inputs)`, its output given the experts the learner's model dequantized while it ran."""

    def run(ex, state, *inputs):
        model = getattr(ex.learner, "model", None)
        before = experts_dequantized(model) if model is not None else 0
        try:
            out = phase(ex, state, *inputs)
        finally:
            if model is not None:  # why: a small model's experts held for the rollout (held_experts.py) end with it
                release(model)
        if model is not None:
            set_count(out, experts_dequantized(model) - before)
        return out

    return run


def rollout_count(rollout, experts: int) -> None:
    rollout.experts_dequantized = experts


def backward_count(result, experts: int) -> None:
    result.stats.experts_dequantized = experts
