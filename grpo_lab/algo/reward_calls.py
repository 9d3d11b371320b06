"""Calling reward functions as TRL 1.16's `GRPOTrainer._calculate_rewards` calls them: the dataset's columns as
keyword lists, `trainer_state`, `log_extra` and `log_metric` beside them; synchronous functions one after another, then
every `async def` one concurrently in one event loop. The loop runs on a thread of its own, so a notebook's running
loop (where `asyncio.run` refuses) and a plain script take the same path, as TRL's own background loop does.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..errors import LabError

_LOOP: Optional[asyncio.AbstractEventLoop] = None
_LOOP_LOCK = threading.Lock()


@dataclass
class RewardState:
    """What TRL hands every reward as `trainer_state` (its TrainerState's fields a reward reads: the step, the run's
    length, the epoch), for rewards shaped by progress."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


@dataclass
class RewardLog:
    """What reward functions logged during one rewards phase: `log_metric(name, value)` scalars and `log_extra(column,
    values)` per-completion columns (TRL's completions table)."""

    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    columns: dict[str, list] = field(default_factory=lambda: defaultdict(list))

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.columns[column].extend(values)

    def means(self) -> dict[str, float]:
        """Each logged metric's mean over the phase (TRL averages them over its logging step)."""
        return {name: sum(values) / len(values) for name, values in self.metrics.items() if values}


def is_async_callable(fn: Callable) -> bool:
    """Whether calling `fn` returns a coroutine: a function, a partial of one, or an object whose __call__ is
    `async def`, as trl.trainer.utils.is_async_callable tests it (why not imported: that module imports transformers'
    Trainer, 90 MiB and 0.7 s in every process that steps, bench/probes/process_baseline.py)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def call_rewards(funcs: list[tuple[str, Callable]], n: int, kwargs: dict) -> list[list[float]]:
    """Each function's values (None -> NaN), in `funcs` order: the synchronous ones in turn, then the async ones
    together. A wrong count or a raised error is one line naming the function."""
    out: list[Optional[list[float]]] = [None] * len(funcs)
    pending = []
    for j, (name, fn) in enumerate(funcs):
        if is_async_callable(fn):
            pending.append(j)
            continue
        out[j] = checked(name, _call(name, fn, kwargs), n)
    if pending:

        async def gather():
            return await asyncio.gather(*(_await(*funcs[j], kwargs) for j in pending))

        for j, values in zip(pending, run_coroutine(gather())):
            out[j] = checked(funcs[j][0], values, n)
    return out


def _call(name: str, fn: Callable, kwargs: dict):
    try:
        return fn(**kwargs)
    except Exception as err:
        if named(name, err) is err:
            raise
        raise named(name, err) from err


async def _await(name: str, fn: Callable, kwargs: dict):
    try:
        return await fn(**kwargs)
    except Exception as err:
        if named(name, err) is err:
            raise
        raise named(name, err) from err


def named(name: str, err: Exception) -> Exception:
    """A reward's own error as one line naming it; out-of-memory errors and the lab's own stay as they are (the
    phase's OOM handling reads them)."""
    if isinstance(err, (LabError, MemoryError)) or "out of memory" in str(err).lower():
        return err
    return LabError(f"reward {name!r} raised {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}")


def checked(name: str, values, n: int) -> list[float]:
    if values is None or len(values) != n:
        raise LabError(
            f"reward {name!r} returned {0 if values is None else len(values)} values for {n} completions; "
            "return one float (or None) per completion"
        )
    return [math.nan if v is None else float(v) for v in values]


def run_coroutine(coroutine):
    """Run `coroutine` on this process's reward loop (a daemon thread, started once) and wait for its result."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="grpo-lab-rewards", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(coroutine, _LOOP).result()
