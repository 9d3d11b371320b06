"""`environment_factory` as TRL 1.16 takes it: a class (or any callable making an instance), or a dict of them chosen
per row by the dataset's `environment` column. Each rollout row gets an instance of its own, drawn from a pool that
is reused across rollouts (TRL's "construct once, reset often"); `reset(**row)` starts it, and a string it returns is
appended to the row's last user message; its public methods are the row's tools, beside the Lab's `tools=`; an
optional `get_reward()` is one more reward source, named after the class, weight 1; rewards receive the rollout's
instances as `environments=`.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Union

from ..algo.reward_calls import is_async_callable
from ..errors import LabError
from .toolbox import Toolbox


def tool_methods(instance) -> list[Callable]:
    """An environment's tools: its public methods but reset and get_reward (listed on the class, as TRL: listing
    the instance would evaluate its properties)."""
    names = [n for n, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)]
    return [getattr(instance, n) for n in names if n not in ("reset", "get_reward") and not n.startswith("_")]


def reward_source(env_type: type) -> Callable:
    """get_reward() of each row whose environment is exactly `env_type` (None for the others: no opinion), as TRL's
    extra reward function, named after the class."""
    if is_async_callable(env_type.get_reward):

        async def get_reward(environments, **kwargs):
            return [await e.get_reward() if type(e) is env_type else None for e in environments]
    else:

        def get_reward(environments, **kwargs):
            return [e.get_reward() if type(e) is env_type else None for e in environments]

    get_reward.__name__ = env_type.__name__  # (the reward's name in the metrics, as TRL logs it)
    return get_reward


class Environments:
    """The run's environment factories, each probed once at construction (reset, tool schemas), and their pools."""

    def __init__(self, factory: Union[Callable, dict], tools: list[Callable]):
        self.multi = isinstance(factory, dict)
        self.factories: dict[Optional[str], Callable] = dict(factory) if self.multi else {None: factory}
        self.tools = list(tools)
        self.pools: dict[Optional[str], list] = {}
        self.reward_funcs: list[Callable] = []
        for name, make in self.factories.items():
            if not callable(make):
                raise LabError(f"environment_factory: {make!r} is not callable; pass a class, or a dict of classes")
            instance = make()
            if not callable(getattr(type(instance), "reset", None)):
                raise LabError(
                    f"environment_factory: {type(instance).__name__} has no reset method; define reset(self, **row) "
                    "(it starts the environment for a row; a string it returns is appended to the prompt)"
                )
            self.toolbox(instance)  # why now: a method without hints or docstring is refused at construction
            self.pools[name] = [instance]
            has_reward = callable(getattr(type(instance), "get_reward", None))
            if has_reward and type(instance).__name__ not in {f.__name__ for f in self.reward_funcs}:
                self.reward_funcs.append(reward_source(type(instance)))

    def toolbox(self, instance) -> Toolbox:
        return Toolbox(self.tools + tool_methods(instance))

    def names(self, extra: dict, rows: int) -> list[Optional[str]]:
        """Each prompt's environment: the `environment` column with a dict of them, else the one."""
        if not self.multi:
            return [None] * rows
        column = extra.get("environment")
        if column is None:
            raise LabError(
                "environment_factory: a dict of environments needs an 'environment' column naming each row's; the "
                "dataset has none (add it, or pass one environment class)"
            )
        unknown = sorted({str(n) for n in column if n not in self.factories})
        if unknown:
            raise LabError(
                f"environment_factory: rows name environment(s) {unknown}, not among {sorted(self.factories)}; "
                "fix the 'environment' column or add them to the dict"
            )
        return list(column)

    def draw(self, names: list[Optional[str]]) -> list:
        """One instance per row: the pool's, made anew only when this rollout needs more of one than exist."""
        taken: dict[Optional[str], int] = {}
        out = []
        for name in names:
            pool, k = self.pools[name], taken.get(name, 0)
            if k == len(pool):
                pool.append(self.factories[name]())
            taken[name] = k + 1
            out.append(pool[k])
        return out

    def reset(self, instance, row: dict, prompt: list[dict]) -> list[dict]:
        """Start `instance` for `row` (TRL's reset(**row); a dict's 'environment' column is not passed); the prompt with
        a returned string appended to its last message."""
        kwargs = {k: v for k, v in row.items() if not (self.multi and k == "environment")}
        observation = instance.reset(**kwargs)
        if observation is None:
            return prompt
        return prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
