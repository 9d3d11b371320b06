"""Room under the host line before one big native allocation: the live guard (memory/live_guard.py) interrupts a
phase between Python bytecodes, so a crossing inside one long native call (the textbook head's [rows, vocab] float32
logits, and the autograd pass over them in backward) is raised only as that call returns, and under a kernel-enforced
limit (placement.host_limit: cgroup) the kernel kills first. So code about to make such an allocation says how big it
will be (`before_allocating`): the guard of the thread's guarded phase, when one is armed, compares it with the room
left under its line now and raises its one-line error first, nothing allocated. Without a guard it is a no-op.

The guard is handed down (`checked_by`, from the memory sampler) rather than imported: algo sits below memory."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

_local = threading.local()  # .check: (bytes, what) -> None, raising when they do not fit; per thread (the phase's)


def before_allocating(nbytes: int, what: str) -> None:
    """`nbytes` of host memory are about to be allocated for `what` in one native call: the armed guard raises its
    error now when they would pass its line."""
    check = getattr(_local, "check", None)
    if check is not None:
        check(nbytes, what)


@contextmanager
def checked_by(check: Callable[[int, str], None]) -> Iterator[None]:
    """`before_allocating` calls `check` in this thread meanwhile."""
    previous = getattr(_local, "check", None)
    _local.check = check
    try:
        yield
    finally:
        _local.check = previous
