"""The live host guard: while a phase's work runs (`LiveGuard.run`), the memory sampler's thread that sees host RAM
cross memory.host_threshold of its limit interrupts that work in the thread that runs it, with the guard's one-line
error raised there as an asynchronous exception (CPython's PyThreadState_SetAsyncExc), so the phase stops at the line
instead of when it ends, and the Lab undoes the step as for any failed phase. Python code is interrupted at its next
bytecode; a crossing inside one long native call (a torch kernel, a C allocation) is raised as that call returns.
Code that swallows every exception in the phase keeps running: the sampler's after-phase veto is the backstop.

Why it never lands outside the phase: the exception is sent only while `run` is armed, at most once per run, under a
lock; `run`'s `finally` disarms under the same lock (and clears one sent but not yet raised; CPython raises it at the
disarm's own calls before that), so it is raised between the work's start and the disarm (inside the work, or in the
`finally` itself: either way out of `run`, inside the phase), never after `run` returns (tests/test_live_guard.py
pounds it from another thread). Raised, it is the guard's own error object again, without the work's frames (they
hold the memory that crossed).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, Optional

_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc  # (thread id, exception class or NULL to clear)


def landing(error: BaseException) -> type:
    """A class the interpreter can raise in another thread (it calls it with no arguments) that is `error` again: a
    subclass of its type, of the same name, whose instance carries the same message."""
    kind = type(error)

    def __init__(self):
        kind.__init__(self, *error.args)
        self.__dict__.update({k: v for k, v in vars(error).items() if k not in vars(self)})

    return type(kind.__name__, (kind,), {"__init__": __init__, "__module__": kind.__module__})


class LiveGuard:
    def __init__(self):
        self._lock = threading.Lock()
        self._thread: Optional[int] = None  # the thread running guarded work (threading.get_ident), None: disarmed
        self._sent = False  # this run's interrupt went out (one per run)
        self._error: Optional[BaseException] = None  # what it raises

    @property
    def armed(self) -> bool:
        """Guarded work is running and has not been interrupted yet."""
        return self._thread is not None and not self._sent

    def run(self, work: Callable, *args):
        """`work(*args)` with the guard armed: an `interrupt` meanwhile is raised in this thread, out of this call."""
        with self._lock:
            self._thread, self._sent = threading.get_ident(), False
        try:
            return work(*args)
        except BaseException as landed:
            if not (self._sent and isinstance(landed, type(self._error))):
                raise
            landed.__traceback__ = None  # why: the work's frames (and the memory that crossed) go with it
            del landed
            raise self._error from None
        finally:
            self._disarm()

    def _disarm(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
            if self._sent and thread is not None:  # why: one sent and not yet raised must not land after the phase
                _set_async_exc(ctypes.c_ulong(thread), None)

    def interrupt(self, error: BaseException) -> bool:
        """Raise `error` in the thread running guarded work, once per run (from the sampler's thread, or that one);
        False when no work is armed or it was already interrupted."""
        with self._lock:
            if self._thread is None or self._sent:
                return False
            self._sent, self._error = True, error
            _set_async_exc(ctypes.c_ulong(self._thread), ctypes.py_object(landing(error)))
        return True
