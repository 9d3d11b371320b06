"""A reward that reads a dataset column, as a TRL user's reward reads one: importable as 'tests.column_reward:bonus'
from the repository root, so a sharded Lab's ranks import it too (Ray puts the driver's working directory on their
path)."""


def bonus(prompts, completions, bonus=None, **kwargs):
    """Each completion's row's `bonus` column, whatever the completion."""
    return [float(b) for b in bonus]


def solution_match(completions, solution, **kwargs):
    """TRL's way of reading a column (its accuracy_reward takes `solution` by name): 1.0 where the text is the row's
    solution."""
    return [float((c[-1]["content"] if isinstance(c, list) else c).strip() == s) for c, s in zip(completions, solution)]


def environment_reward(environments, **kwargs):
    """TRL's environment_factory example: each row's environment says its reward."""
    return [env.reward for env in environments]


def no_trainer_state(prompts, completions, completion_ids, answer):
    """Takes neither **kwargs nor the trainer_state, log_extra and log_metric that every reward call passes."""
    return [0.0 for _ in completions]
