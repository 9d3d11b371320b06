"""The phases of a GRPO step, named and ordered once. The Lab's phase methods and grpo.py's phase functions carry
these names; the timeline, the memory tables, the report's colour bands, the panel's phase walk and the lifecycle's
"what runs next" all read this registry, so a phase is never spelled, or ordered, two ways.

    rollout -> rewards -> advantages -> logprobs -> (backward -> optimizer) x num_iterations -> sync
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Phase:
    name: str  # the Lab method, the grpo.py function and the timeline's label
    colour: str  # band colour in the report and the live plot
    does: str  # one line for tooltips and docs
    done: Callable  # done(step, num_iterations): the current step needs this phase no more (lifecycle.next_phase)
    inputs: tuple[str, ...] = ()  # what the Lab method takes, from the current step (lifecycle.StepState fields)
    output: Optional[str] = None  # the StepState field that keeps what it returned (None: sync ends the step)


def _has(field: str) -> Callable:
    return lambda step, iterations: getattr(step, field) is not None


PHASES: tuple[Phase, ...] = (
    Phase(
        "rollout",
        "#4c78a8",
        "sample num_generations completions for each of prompts_per_step prompts",
        _has("rollout"),
        output="rollout",
    ),
    Phase(
        "rewards",
        "#9ecae9",
        "score every completion with the reward functions",
        _has("rewards"),
        ("rollout",),
        "rewards",
    ),
    Phase(
        "advantages",
        "#f58518",
        "group-relative advantages from the rewards",
        _has("advantages"),
        ("rewards",),
        "advantages",
    ),
    Phase("logprobs", "#72b7b2", "reference log-probs (when beta > 0)", _has("logprobs"), ("rollout",), "logprobs"),
    Phase(
        "backward",
        "#e45756",
        "loss and gradients, micro-batch by micro-batch (old log-probs on the first iteration)",
        lambda step, iterations: step.gradients or step.updates >= iterations,
        ("rollout", "advantages", "logprobs"),
        "stats",
    ),
    Phase(
        "optimizer",
        "#54a24b",
        "clip and apply the update to the LoRA weights",
        lambda step, iterations: not step.gradients and step.updates >= iterations,
        output="grad_norm",
    ),
    Phase(
        "sync", "#b279a2", "push the LoRA weights to the generator; the step ends here", lambda step, iterations: False
    ),
)
BY_NAME: dict[str, Phase] = {p.name: p for p in PHASES}
PHASE_NAMES: tuple[str, ...] = tuple(BY_NAME)
COLOURS: dict[str, str] = {p.name: p.colour for p in PHASES}
UPDATE_PHASES = ("backward", "optimizer", "sync")  # redone from scratch when a step is rolled back
