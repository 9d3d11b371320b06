"""One step's lifecycle: what its phases produced so far, and which phase may run next.

A step starts with a rollout and ends when its sync ends; its index then advances by itself.
Each phase's inputs must be the ones this step produced (a rollout of an earlier step is refused),
its inputs are fixed once the first update is applied, and it takes `grpo.num_iterations`
backward+optimizer pairs before sync. The rollback snapshot belongs to the step: taken by its
first optimizer phase, restored on a failure, dropped when the step ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import LabError
from .phases import BY_NAME, PHASE_NAMES, PHASES, UPDATE_PHASES

PENDING_HOW = "finish them with lab.rollout() or drop them with lab.rollback()"


@dataclass
class StepState:
    index: int
    rollout: Any = None
    rewards: Any = None
    advantages: Any = None
    logprobs: Any = None
    stats: Any = None
    grad_norm: Optional[float] = None
    # what the rollout's first backward records from its own forward (grpo.backward), for its later iterations:
    old_logprobs: Any = None  # [N, L] the learner's log-probs before the step's first update, detached
    is_weights: Any = None  # [N, L] or [N, 1] the last backward's importance-sampling weights (None: off)
    updates: int = 0  # optimizer updates applied in this step
    gradients: bool = False  # a backward's gradients wait for the optimizer phase
    # LoRA + optimizer state before the step's first update: a rollback.RollbackSnapshot (a sharded driver's:
    # rollback.SnapshotsOnRanks)
    snapshot: Any = None
    attempts: int = 1  # 1 + rolled-back attempts
    turns: Any = None  # a rollout run turn by turn, pending between its calls (grpo_lab/turns_api.PendingTurns)
    # the random streams each phase of the step first started from, kept until the step ends: a failed phase's retry
    # draws from them again (recovery/streams.py)
    streams: dict = field(default_factory=dict)

    @property
    def started(self) -> bool:
        return self.rollout is not None or self.turns is not None


def next_phase(step: StepState, num_iterations: int) -> str:
    """The first phase, in PHASES order, that the step still needs."""
    return next(phase.name for phase in PHASES if not phase.done(step, num_iterations))


def _same(step: StepState, phase: str, name: str, given) -> None:
    """`given` (an input named after the phase that produced it) must be what this step's `name` phase returned; a
    refusal starts with the phase that was called (`phase`), the one the user's line names."""
    expected = getattr(step, name)
    if expected is None and name == "rollout" and step.turns is not None:
        raise LabError(f"{phase}: step {step.index}'s rollout has turns pending; {PENDING_HOW}, first")
    if expected is None and name == "rollout" and getattr(given, "step", step.index) != step.index:
        raise LabError(
            f"{phase}: this is step {given.step}'s rollout, and step {step.index} has none yet; "
            "run lab.rollout() to start it"
        )
    if expected is None:
        raise LabError(
            f"{phase}: step {step.index} has no {name} yet; run lab.{name}(...) first "
            f"(phases run in order: {', '.join(PHASE_NAMES)})"
        )
    if given is not expected:
        whose = (
            f"step {given.step}'s" if name == "rollout" and getattr(given, "step", -1) != step.index else "an earlier"
        )
        raise LabError(
            f"{phase}: this is {whose} {name}, not the one step {step.index} produced; pass the value "
            f"lab.{name}(...) returned in this step"
        )


def _inputs_fixed(step: StepState, phase: str) -> None:
    if step.updates or step.gradients:
        done = f"applied {step.updates} update(s)" if step.updates else "gradients waiting for lab.optimizer()"
        raise LabError(
            f"{phase}: step {step.index} has {done}, so its inputs are fixed; "
            "finish it (lab.step() runs the rest), or undo it with lab.rollback() first"
        )


def check_between_steps(step: StepState, what: str, next_phase: str) -> None:
    """Refuse, in one line, `what` (a call that needs a step boundary) while a step is under way."""
    if step.turns is not None:
        raise LabError(f"{what}: step {step.index}'s rollout has turns pending; {PENDING_HOW}, first")
    if step.started:
        raise LabError(f"{what}: step {step.index} is under way (next: {next_phase}); lab.step() first")


def check_order(step: StepState, phase: str, num_iterations: int, **inputs) -> None:
    """Refuse, in one line, a phase called out of order or with inputs that are not this step's."""
    for name in BY_NAME[phase].inputs:  # the registry says what each phase takes from the step
        _same(step, phase, name, inputs[name])
    if phase not in UPDATE_PHASES:  # the phases an update is computed from
        _inputs_fixed(step, phase)
    if phase == "backward" and step.updates >= num_iterations:
        raise LabError(
            f"backward: step {step.index} has done its {step.updates} update(s) "
            f"(grpo.num_iterations = {num_iterations}); finish it with lab.sync()"
        )
    if phase == "optimizer" and not step.gradients:
        raise LabError(
            f"optimizer: step {step.index} has no gradients to apply; run lab.backward(rollout, "
            "advantages, logprobs) first"
        )
    if phase == "sync" and step.updates < num_iterations:
        raise LabError(
            f"sync: step {step.index} has done {step.updates} of grpo.num_iterations = {num_iterations} "
            "update(s); run lab.backward(...) and lab.optimizer() until it has"
        )


class RestOfStep:
    """A Lab's phase methods as `grpo.step` calls them, resuming the current step: a phase the step needs no more
    gives back what it produced (so `lab.step()` after a failure retries from the failed phase)."""

    def __init__(self, lab):
        self.lab = lab

    def __getattr__(self, name: str):
        if name not in BY_NAME:
            raise AttributeError(name)
        phase, lab = BY_NAME[name], self.lab

        def run(*inputs):
            if phase.done(lab.current, lab.config.grpo.num_iterations):
                return getattr(lab.current, phase.output)
            return getattr(lab, name)(*inputs)

        return run
