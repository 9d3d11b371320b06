"""The phases of a GRPO step, named once. The Lab's phase methods and algo/grpo.py's phase functions
carry these names; the timeline, the memory tables, the report's colour bands and the panel's
phase walk all read this registry, so a phase is never spelled two ways.

    rollout -> rewards -> advantages -> logprobs -> backward -> optimizer -> sync
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    name: str       # the Lab method, the algo/grpo.py function and the timeline's label
    colour: str     # band colour in the report and the live plot
    does: str       # one line for tooltips and docs
    inputs: tuple[str, ...] = ()   # what the Lab method takes, from the current step (lifecycle.StepState fields)


PHASES: tuple[Phase, ...] = (
    Phase("rollout", "#4c78a8", "sample num_generations completions for each of prompts_per_step prompts"),
    Phase("rewards", "#9ecae9", "score every completion with the reward functions", ("rollout",)),
    Phase("advantages", "#f58518", "group-relative advantages from the rewards", ("rewards",)),
    Phase("logprobs", "#72b7b2", "reference log-probs (when beta > 0)", ("rollout",)),
    Phase("backward", "#e45756", "loss and gradients, micro-batch by micro-batch (old log-probs on the first iteration)",
          ("rollout", "advantages", "logprobs")),
    Phase("optimizer", "#54a24b", "clip and apply the update to the LoRA weights"),
    Phase("sync", "#b279a2", "push the LoRA weights to the generator; the step ends here"),
)
BY_NAME: dict[str, Phase] = {p.name: p for p in PHASES}
PHASE_NAMES: tuple[str, ...] = tuple(BY_NAME)
COLOURS: dict[str, str] = {p.name: p.colour for p in PHASES}
UPDATE_PHASES = ("backward", "optimizer", "sync")   # redone from scratch when a step is rolled back
