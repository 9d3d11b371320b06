"""Failures on demand, for showing recovery (`lab.arm_fault`, notebook 06) and for tests: a fault is armed for one
phase of this process and fires once, at a named point inside that phase's real code path:

- `decode`: the rollout's third decoding step (hf generation);
- `forward`: inside the first decoder layer's forward, after FSDP's pre-forward hook has gathered it, of every
  log-prob pass the phase runs (the policy's, the reference's: logprobs and backward alike);
- `loss`: the backward's first micro-batch loss becomes NaN (what a bad reward or a diverged weight produces);
- `checksum`: a sharded rollout's token ids as this rank hashes them after the gather differ by one token (what ranks
  whose prompts or sampling diverged would hold; generation/sample_once.py).

No mocks: the points are hooks the code calls or module hooks it registers, so a fault exercises exactly what a real
failure there does (FSDP's iteration state mid-forward included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import LabError

ERRORS = ("oom", "runtime", "nan", "diverge", "kill")  # kill: SIGKILL of this process at the point (a rank's death)
POINTS = {"rollout": ("decode",), "logprobs": ("forward",), "backward": ("forward", "loss")}


@dataclass
class Fault:
    phase: str
    error: str
    count: int = 0  # calls of its point seen so far in the armed phase

    @property
    def point(self) -> str:
        return {"nan": "loss", "diverge": "checksum"}.get(self.error) or POINTS[self.phase][0]


_ARMED: Optional[Fault] = None
_PHASE: Optional[str] = None  # the phase this process runs now (set by the Lab around each phase)


def check(phase: str, error: str) -> None:
    if phase not in POINTS:
        raise LabError(f"arm_fault: phase {phase!r}; faults go into {', '.join(POINTS)}")
    if error not in ERRORS:
        raise LabError(f"arm_fault: error {error!r}; use one of {', '.join(ERRORS)}")
    if error == "nan" and phase != "backward":
        raise LabError(
            f"arm_fault: error 'nan' poisons a loss, which only backward computes; arm it on backward, not {phase}"
        )
    if error == "diverge" and phase != "rollout":
        raise LabError(
            f"arm_fault: error 'diverge' alters a sharded rollout's checksum; arm it on rollout, not {phase}"
        )


def arm(phase: str, error: str) -> None:
    """Make this process's next `phase` fail once (error 'oom': torch.OutOfMemoryError, 'runtime': RuntimeError,
    'nan': a NaN loss, 'diverge': a sharded rollout this rank holds differently, 'kill': SIGKILL of the process)."""
    global _ARMED
    check(phase, error)
    _ARMED = Fault(phase, error)


def armed() -> Optional[Fault]:
    return _ARMED


def set_phase(name: Optional[str]) -> None:
    global _PHASE
    _PHASE = name


def _due(point: str, nth: int = 1) -> Optional[Fault]:
    """The armed fault if it fires at this call of `point` (its `nth` in the armed phase); disarmed when it fires."""
    global _ARMED
    fault = _ARMED
    if fault is None or fault.phase != _PHASE or fault.point != point:
        return None
    fault.count += 1
    if fault.count < nth:
        return None
    _ARMED = None
    return fault


def _exception(fault: Fault) -> BaseException:
    if fault.error == "oom":
        return torch.OutOfMemoryError("Tried to allocate 2.00 GiB (injected by lab.arm_fault)")
    return RuntimeError(f"injected failure in {fault.phase} (lab.arm_fault)")


def fire(point: str, nth: int = 1) -> None:
    """Raise the armed fault if it is due at this call of `point` ('kill': the process dies there, as under the
    kernel's OOM killer)."""
    fault = _due(point, nth)
    if fault is not None and fault.error == "kill":
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if fault is not None:
        raise _exception(fault)


def poison(loss: torch.Tensor) -> torch.Tensor:
    """The loss, or NaN when a 'nan' fault is due (the `loss` point)."""
    return loss * float("nan") if _due("loss") is not None else loss


def diverge(token_ids: torch.Tensor) -> torch.Tensor:
    """The token ids, or a copy with its first one changed when a 'diverge' fault is due (the `checksum` point)."""
    if _due("checksum") is None:
        return token_ids
    changed = token_ids.clone()
    changed.view(-1)[0] += 1
    return changed


def watch_forward(model) -> None:
    """Register the `forward` point on `model`'s first decoder layer (a pre-hook after FSDP's, which is prepended)."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(causal, causal.base_model_prefix), "layers", None)
    if layers is not None and len(layers) and not getattr(layers[0], "_grpo_lab_fault_point", False):
        layers[0].register_forward_pre_hook(lambda module, args: fire("forward"))
        layers[0]._grpo_lab_fault_point = True
