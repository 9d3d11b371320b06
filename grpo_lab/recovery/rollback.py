"""All-or-nothing steps. Only the optimizer step mutates the LoRA weights and the optimizer
state, so a host copy of exactly those, taken just before the first update of a step, is enough
to put a failed step back as it was (gradients are simply dropped)."""

from __future__ import annotations

import copy

import torch


class RollbackSnapshot:
    """This process's LoRA weights and AdamW state, on the host, before the step's first update."""

    def __init__(self, learner):
        params = learner.trainable_parameters()
        # why on the host: the copy costs host RAM (LoRA weights + two AdamW moments), never GPU memory
        self.params = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
        self.optimizer = _to_cpu(learner.optimizer.state_dict())

    def restore(self, learner) -> None:
        with torch.no_grad():
            for name, param in learner.trainable_parameters().items():
                param.copy_(self.params[name])
        learner.optimizer.load_state_dict(self.optimizer)
        learner.optimizer.zero_grad(set_to_none=True)  # why: a failed step's partial gradients are garbage


class SnapshotsOnRanks:
    """A sharded learner's snapshot, as its driver holds it: every rank took its own RollbackSnapshot of its shards and
    restores it when the driver says rollback (the driver has nothing to restore itself)."""

    def restore(self, learner) -> None:
        raise RuntimeError("a sharded learner's snapshot is restored by each rank, not by its driver")


def _to_cpu(state):
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_cpu(v) for v in state)
    return copy.deepcopy(state)
