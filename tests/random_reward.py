"""A reward drawn from Python's `random` (as a user's reward function may), importable as 'random_reward:noisy'
(tests/ on the path): a run's metrics then depend on `random`'s state at every step, so a resume must restore it."""

import random


def noisy(prompts, completions, **kwargs):
    """A uniform draw per completion, whatever the completion."""
    return [random.random() for _ in completions]
