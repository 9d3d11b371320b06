"""Reward functions: a registry of named functions with TRL's reward-function signature
`f(prompts, completions, **kwargs) -> list[float]` (dataset columns such as `answer` and
`completion_ids` arrive as keyword lists), TRL's own reward functions by the names its `trl grpo` script gives them,
and what TRL passes every reward beside the columns (`trainer_state`, `log_extra`, `log_metric`). Any user callable
with that signature works too, `async def` ones run concurrently (reward_calls.py calls them all).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from decimal import Decimal
from typing import Callable, Optional, Union

from ..errors import LabError

_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.S)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def completion_text(completion) -> str:
    """A completion's text: plain text, or the last message's content in TRL's conversational format."""
    if isinstance(completion, list):
        return completion[-1]["content"] if completion else ""
    return completion


def extract_answer(text: str) -> Optional[str]:
    """The content of the last <answer>...</answer>, else the last number in the text."""
    tagged = _ANSWER.findall(text)
    if tagged:
        return tagged[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def exact_answer(prompts, completions, answer=None, **kwargs) -> list[float]:
    """1.0 when the extracted answer equals the reference answer, else 0.0."""
    if answer is None:
        raise LabError("reward 'exact_answer' needs an 'answer' for every prompt; use a dataset with answers")
    got = [extract_answer(completion_text(c)) for c in completions]
    return [float(_same_answer(g, str(a).strip())) for g, a in zip(got, answer)]


def _same_answer(got: Optional[str], want: str) -> bool:
    """Equal text, or equal numbers where both are numbers: an answer column Arrow reads as float holds 2.0 for a
    completion's 2."""
    if got is None:
        return False
    if _NUMBER.fullmatch(got) and _NUMBER.fullmatch(want):
        return Decimal(got) == Decimal(want)
    return got == want


def format_reward(prompts, completions, **kwargs) -> list[float]:
    """1.0 for exactly one well-formed <answer>...</answer>, 0.5 for a tag without a number, else 0."""
    out = []
    for c in completions:
        tags = _ANSWER.findall(completion_text(c))
        out.append(1.0 if len(tags) == 1 and _NUMBER.fullmatch(tags[0]) else 0.5 if tags else 0.0)
    return out


def length_reward(prompts, completions, completion_ids=None, target_length: int = 16, **kwargs) -> list[float]:
    """1 - |len - target| / target, floored at -1: prefers completions near `target_length` tokens."""
    lengths = (
        [len(ids) for ids in completion_ids]
        if completion_ids is not None
        else [len(completion_text(c).split()) for c in completions]
    )
    return [max(-1.0, 1.0 - abs(n - target_length) / target_length) for n in lengths]


def concise_reward(prompts, completions, target_chars: int = 200, **kwargs) -> list[float]:
    """target_chars / (target_chars + its characters): 1 for empty text, 0.5 at `target_chars`, shorter text always
    scoring more. Unlike `length` (tokens), it tells apart completions cut at the same max_completion_length (a random
    model's, which never samples EOS), so a group's rewards differ and the step has a gradient."""
    return [target_chars / (target_chars + len(completion_text(c))) for c in completions]


REWARDS: dict[str, Callable] = {
    "exact_answer": exact_answer,
    "format": format_reward,
    "length": length_reward,
    "concise": concise_reward,
}


def _trl_reward(name: str) -> Callable:
    import trl.rewards

    return getattr(trl.rewards, name)


# TRL's reward functions, by the names TRL's `trl grpo` command gives them, made when named (why lazily: each
# imports trl.rewards, and accuracy_reward needs math-verify)
TRL_REWARDS: dict[str, Callable[[], Callable]] = {
    "accuracy_reward": lambda: _trl_reward("accuracy_reward"),
    "reasoning_accuracy_reward": lambda: _trl_reward("reasoning_accuracy_reward"),
    "think_format_reward": lambda: _trl_reward("think_format_reward"),
    # the values trl grpo uses for it
    "get_soft_overlong_punishment": lambda: _trl_reward("get_soft_overlong_punishment")(
        max_completion_len=1280, soft_punish_cache=256
    ),
}
NEEDS_MATH_VERIFY = {"accuracy_reward", "reasoning_accuracy_reward"}


def trl_reward(name: str) -> Callable:
    """One of TRL's reward functions by its `trl grpo` name; one line when what it needs is not installed."""
    if name in NEEDS_MATH_VERIFY and importlib.util.find_spec("math_verify") is None:
        raise LabError(
            f"data.rewards: TRL's {name} needs math-verify to check answers; pip install math-verify "
            "(scripts/install.sh installs it)"
        )
    return TRL_REWARDS[name]()


def resolve_reward(spec: Union[str, Callable]) -> Callable:
    """A registry name, one of TRL's reward names, a 'module:function' import path, or a callable."""
    if callable(spec):
        return spec
    if spec in REWARDS:
        return REWARDS[spec]
    if spec in TRL_REWARDS:
        return trl_reward(spec)
    module, sep, attr = spec.partition(":")
    if not sep:
        raise LabError(
            f"data.rewards: unknown reward {spec!r}; use one of {sorted([*REWARDS, *TRL_REWARDS])} or 'module:function'"
        )
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise LabError(f"data.rewards: cannot import {spec!r} ({err}); check the module path") from None
    if not callable(fn):
        raise LabError(f"data.rewards: {spec!r} is not callable")
    check_reward_signature(spec, fn)
    return fn


# What every reward call passes, whatever the data (TRL's GRPOTrainer._calculate_rewards: the dataset's columns beside)
EVERY_CALL = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def check_reward_signature(spec: str, fn: Callable) -> None:
    """A named function must take the keywords every reward call passes, or the first step would fail on it. A
    parameter it names beyond them (a column, as TRL's accuracy_reward names `solution`, or `environments`) is the
    data's to supply: bound here as given, and a missing one is the call's one-line error naming the reward."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # no introspectable signature (some builtins): called as it is
    data = {
        name: []
        for name, p in signature.parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and name not in EVERY_CALL
    }
    try:
        signature.bind(**dict.fromkeys(EVERY_CALL, []), **data)
    except TypeError as err:
        raise LabError(
            f"data.rewards: {spec!r} does not take the reward arguments ({err}); "
            "define it as f(prompts, completions, **kwargs)"
        ) from None


def reward_name(fn: Callable) -> str:
    for name, registered in REWARDS.items():
        if registered is fn:
            return name
    return getattr(fn, "__name__", type(fn).__name__)


def reward_functions(given, config) -> list[Callable]:
    """The run's reward functions: those passed to the Lab, else the ones data.rewards names (both executors')."""
    return [resolve_reward(r) for r in (given or config.data.rewards)]
