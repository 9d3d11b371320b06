"""Ctrl-C while the driver waits on its ranks (execution/sharded/interrupts.py): held, it is raised at the driver's own
next turn, never inside a foreign call that can drop it. The foreign call here does what Ray's does: its signal check
runs Python's handlers and turns a KeyboardInterrupt into a status (ray/_raylet.pyx check_signals), which a caller may
drop. No Ray is needed for the mechanism; tests/test_sharded.py interrupts real ranks."""

from __future__ import annotations

import os
import signal

import pytest

from grpo_lab.execution.sharded.interrupts import HeldInterrupts

pytestmark = pytest.mark.usefixtures("python_sigint")  # why: a suite started in the background inherits SIGINT ignored


def ray_like_wait() -> str:
    """A blocking call that checks signals as Ray's C++ waits do, through its check_signals callback: a
    KeyboardInterrupt raised by the handler becomes a status; this path drops it (returns as if the wait ended)."""
    try:
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C lands while the driver is inside the wait
        for _ in range(1000):  # the handler runs at one of these bytecodes
            pass
    except KeyboardInterrupt:
        return "interrupted"  # Ray's CRayStatus.Interrupted, dropped by the path that called it
    return "ok"


def test_without_the_hold_a_ctrl_c_inside_a_ray_like_wait_is_lost():
    """The premise: the interrupt is consumed inside the foreign call and never reaches the caller."""
    assert ray_like_wait() == "interrupted"
    for _ in range(1000):
        pass  # nothing pending: no KeyboardInterrupt here


def test_held_a_ctrl_c_inside_a_ray_like_wait_is_raised_at_the_drivers_next_turn():
    held = HeldInterrupts()
    turns = []
    with pytest.raises(KeyboardInterrupt):
        with held.held():
            assert ray_like_wait() == "ok"  # the handler only noted it: the foreign call could not drop it
            turns.append("after the wait")
            held.check()  # the driver's next turn
            turns.append("not reached")
    assert turns == ["after the wait"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the caller's handler is back


def test_a_ctrl_c_noted_as_the_block_ends_is_raised_when_it_ends_and_nested_holds_restore_once():
    held = HeldInterrupts()
    with pytest.raises(KeyboardInterrupt):
        with held.held():
            with held.held():
                ray_like_wait()
            assert signal.getsignal(signal.SIGINT) == held._note  # the inner hold restored nothing
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with held.held():  # nothing noted: nothing raised
        pass


def test_the_callers_own_handler_decides_what_a_held_ctrl_c_does_and_an_ignored_one_stays_ignored():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        held = HeldInterrupts()
        with held.held():
            ray_like_wait()
            assert not seen
        assert seen == [signal.SIGINT]  # raised through the caller's handler (Jupyter's, a CLI's), once
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with held.held():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # ignored, as the caller asked
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_let_through_gives_the_driver_engines_long_work_the_callers_handler_and_raises_a_noted_one_first():
    held = HeldInterrupts()
    with held.held():
        with held.let_through():
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)  # raised at once, inside the engine's work
                for _ in range(1000):
                    pass
        assert signal.getsignal(signal.SIGINT) == held._note
        ray_like_wait()
        with pytest.raises(KeyboardInterrupt):
            with held.let_through():
                pytest.fail("a noted interrupt must be raised before the long work starts")
