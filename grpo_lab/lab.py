"""`Lab`: the notebook's handle on a GRPO run. It holds the config, learner, generator,
reference, prompts and history; each phase of a step is a method a cell can call alone,
and `step()` composes them. The headless runner, the widgets and papermill use the same calls.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Union

import torch

from . import step as phases
from .config import LabConfig, load_config
from .errors import LabError
from .phases import Timeline
from .rewards import resolve_reward
from .types import Advantages, LogProbs, LossStats, Rewards, Rollout, StepResult


def preflight(config: LabConfig) -> None:
    """Everything that can be checked before a weight is loaded."""
    from .data import load_rows
    from .devices import check_model_path, check_placement

    check_placement(config)
    check_model_path(config.model.name_or_path)
    for name in config.data.rewards:
        resolve_reward(name)
    if config.data.dataset != "arithmetic":
        load_rows(config.data.dataset, config.data.num_prompts, config.run.seed)


class Lab:
    def __init__(self, config: Union[LabConfig, dict, str, Path], reward_funcs: Optional[list[Callable]] = None,
                 overrides: Optional[list[str]] = None):
        self.config = load_config(config, overrides)
        self.reward_funcs = [resolve_reward(r) for r in (reward_funcs or self.config.data.rewards)]
        self.learner = self.generator = self.reference = self.prompts = None
        self.timeline = Timeline()
        self.history: list[StepResult] = []
        self.step_index = 0   # the step the next phase belongs to

    # --- setup ---
    def load(self) -> "Lab":
        """Check the plan, then load the learner, reference, generator and prompts."""
        from .data import PromptSource, load_rows
        from .generation import backend_class
        from .learner import load_learner
        from .reference import build_reference

        cfg = self.config
        preflight(cfg)
        self.learner = load_learner(cfg)
        self.reference = build_reference(cfg)
        self.generator = backend_class(cfg.generator.backend)(self.learner, cfg)
        rows = load_rows(cfg.data.dataset, cfg.data.num_prompts, cfg.run.seed)
        self.prompts = PromptSource(rows, self.learner.tokenizer, cfg.data.system_prompt, cfg.run.seed)
        torch.manual_seed(cfg.run.seed)  # why here: sampling randomness starts from the seed, whatever loading consumed
        return self

    def _require_loaded(self):
        if self.learner is None:
            raise LabError("the lab is not loaded; call lab.load() first")

    # --- the phases of a step, each timed and marked ---
    def rollout(self) -> Rollout:
        self._require_loaded()
        with self.timeline.phase("rollout", self.step_index):
            return phases.rollout(self.generator, self.prompts, self.config)

    def rewards(self, rollout: Rollout) -> Rewards:
        with self.timeline.phase("rewards", self.step_index):
            return phases.score(rollout, self.reward_funcs, self.config.data.reward_weights)

    def advantages(self, rewards: Rewards) -> Advantages:
        with self.timeline.phase("advantages", self.step_index):
            return phases.compute_advantages(rewards, self.config.grpo.num_generations, self.config.grpo.scale_rewards)

    def logprobs(self, rollout: Rollout) -> LogProbs:
        self._require_loaded()
        with self.timeline.phase("logprobs", self.step_index):
            return phases.compute_logprobs(self.learner, self.reference, rollout, self.config)

    def loss_and_backward(self, rollout: Rollout, advantages: Advantages, logprobs: LogProbs) -> LossStats:
        self._require_loaded()
        with self.timeline.phase("backward", self.step_index):
            return phases.loss_and_backward(self.learner, rollout, advantages, logprobs, self.config)

    def optimizer_step(self) -> float:
        self._require_loaded()
        with self.timeline.phase("optimizer", self.step_index):
            return phases.optimizer_step(self.learner, self.config.grpo.max_grad_norm)

    def sync(self) -> None:
        self._require_loaded()
        with self.timeline.phase("sync", self.step_index):
            phases.sync_generator(self.generator, self.learner)

    # --- composition ---
    def step(self) -> StepResult:
        """Run one whole GRPO step and append its result to `history`."""
        self._require_loaded()
        result = phases.step(self)
        self.history.append(result)
        self.step_index += 1
        return result

    def run(self, steps: int) -> list[StepResult]:
        return [self.step() for _ in range(steps)]

    def save_adapter(self, path: Union[str, Path]) -> Path:
        from .learner import save_adapter

        self._require_loaded()
        return save_adapter(self.learner, path)

    def close(self) -> None:
        """Release the generator and models (the Python objects go with the Lab)."""
        if self.generator is not None:
            self.generator.close()
        self.learner = self.generator = self.reference = None
