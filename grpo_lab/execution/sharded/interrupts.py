"""Ctrl-C while the driver talks to its ranks. Python runs a SIGINT handler at the next bytecode of the main thread,
wherever that is, and while the driver waits on Ray that is often Python code Ray calls from its own C++ (its
signal check, task submission, a reference's callbacks): there a KeyboardInterrupt is turned into a status that a
path may drop, or printed as "Exception ignored" and lost (ray-project/ray#7734), or left set so that the call fails
as a SystemError ("returned a result with an exception set"). The interrupt then never reached the caller, and the
ranks went on (the lost Ctrl-C of a sharded rollout on a busy machine).

So while the driver holds the ranks' command (`held()`), SIGINT only notes itself, and the driver raises it at a point
of its own (`check()`, at every turn of its wait: at most ranks.STREAM_S later), with every rank then stopped by the
exchange it was in. Nothing of the kind runs off the main thread (signals reach only it) or where SIGINT is ignored.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


class HeldInterrupts:
    """The process's one hold (signals are per process): nested holds share it; the outermost installs and restores
    the handler."""

    def __init__(self):
        self.depth = 0
        self.noted = False
        self.previous = None  # the handler the outermost hold replaced (the caller's: Python's, Jupyter's)

    def _note(self, signum, frame) -> None:
        self.noted = True  # why nothing more: this may run inside Ray's own calls, where a raise can be lost

    @contextmanager
    def held(self) -> Iterator[None]:
        """SIGINT noted, not raised, for the block; one noted and not yet raised is raised as the block ends."""
        if threading.current_thread() is not threading.main_thread() or (
            self.depth == 0 and not callable(signal.getsignal(signal.SIGINT))  # ignored, or the OS default: as asked
        ):
            yield
            return
        if self.depth == 0:
            self.previous, self.noted = signal.signal(signal.SIGINT, self._note), False
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                signal.signal(signal.SIGINT, self.previous)
        self.check()  # (not reached when the block raised: that error goes on, and with it the stop)

    def check(self) -> None:
        """Raise a noted interrupt here, as the caller's own handler would (Python's raises KeyboardInterrupt)."""
        if self.noted:
            self.noted = False
            (self.previous if callable(self.previous) else signal.default_int_handler)(signal.SIGINT, None)

    @contextmanager
    def let_through(self) -> Iterator[None]:
        """The caller's handler back for a block that may take long in this process (the driver's engine sampling
        for the ranks), so that Ctrl-C interrupts it at once; a noted interrupt is raised first."""
        if self.depth == 0 or threading.current_thread() is not threading.main_thread():
            yield
            return
        self.check()
        mine = signal.signal(signal.SIGINT, self.previous)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, mine)


INTERRUPTS = HeldInterrupts()
