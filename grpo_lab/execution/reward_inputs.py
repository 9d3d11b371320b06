"""What a one-process rewards phase hands the algorithm (execution/local.py): the reward functions in TRL's order
(functions, reward models, environments' get_reward) with their weights, and TRL's `trainer_state`."""

from __future__ import annotations

from typing import Optional

from ..models.reward_model import is_reward_model, wrap_module


def scorers(given: Optional[list], config) -> Optional[list]:
    """The reward functions passed to the Lab, a sequence classifier among them wrapped as TRL takes one (its own
    tokenizer, its score at the last token); in their order, so reward_weights line up as in TRL."""
    return None if given is None else [wrap_module(f, config) if is_reward_model(f) else f for f in given]


def reward_state(ex):
    """TRL's `trainer_state` as rewards read it: the step, the run's steps, the epoch of the data drawn so far."""
    from ..algo.reward_calls import RewardState

    epoch = getattr(ex.prompts, "epoch", 0.0)  # (the worst-case probe's prompts stand outside the epochs)
    return RewardState(global_step=ex.step_index(), max_steps=ex.config.run.steps, epoch=epoch)


def reward_sources(ex) -> tuple[list, Optional[list]]:
    """The reward functions and their weights: the run's, its reward models', then its environments' get_reward
    (weight 1, as TRL)."""
    extra = ex.tools.reward_funcs if ex.tools is not None else []
    weights = ex.config.data.reward_weights  # (one per function, then one per reward model, as TRL counts them)
    funcs = [*ex.reward_funcs, *ex.reward_models, *extra]
    return funcs, (weights + [1.0] * len(extra) if weights is not None else None)


def check_new_reward_models(config, new) -> None:
    """An edit of data.reward_models is checked before its rebuild, which drops the old models first."""
    from ..models.reward_model import check_reward_model

    if new.data.reward_models != config.data.reward_models:
        for name in new.data.reward_models:
            check_reward_model(name)
