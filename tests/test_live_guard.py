"""The live host guard (issue 68, item 1): while a phase's work runs, the sampler that sees host RAM cross
memory.host_threshold of its limit stops the work there, in the thread that runs it, with the one-line error the
after-phase veto gives; the step is undone as for any failed phase, the process lives and the Lab steps again. The
interrupt (an asynchronous exception) lands inside the guarded work or not at all: never after it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from grpo_lab import Lab
from grpo_lab.memory.live_guard import LiveGuard
from grpo_lab.memory.readers import MiB
from grpo_lab.memory.sampler import HostMemoryExceeded

pytestmark = pytest.mark.xdist_group("live_guard")  # why: its Lab tests allocate hundreds of MiB against a budget

STEP = 8 * MiB  # the allocation loop's step
BOUND = 96 * MiB  # how far past the line the loop may get before it is stopped (a few steps, on a loaded machine)


def crossing(where: str = "during phase 'rewards' of step 0") -> HostMemoryExceeded:
    return HostMemoryExceeded(f"host RAM reached 96.0% of 1.00 GiB (memory.host_threshold=0.95); {where}", "fix it")


def later(seconds: float, guard: LiveGuard, error: BaseException) -> threading.Thread:
    """Interrupt `guard`'s work from another thread (the sampler's, in a Lab) after `seconds`."""
    thread = threading.Thread(target=lambda: (time.sleep(seconds), guard.interrupt(error)))
    thread.start()
    return thread


def test_an_interrupt_stops_python_work_there_with_the_guards_own_error():
    guard, error, spins = LiveGuard(), crossing(), [0]

    def work():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            spins[0] += 1
        return "ran to its end"

    sender = later(0.05, guard, error)
    started = time.monotonic()
    with pytest.raises(HostMemoryExceeded) as caught:
        guard.run(work)
    sender.join()
    assert time.monotonic() - started < 5 and spins[0] > 0  # stopped mid-loop, not at its end
    frames, tb = [], caught.value.__traceback__
    while tb is not None:
        frames, tb = [*frames, tb.tb_frame.f_code.co_name], tb.tb_next
    assert caught.value is error and frames[-1] == "run" and "work" not in frames  # the work's frames let go
    assert not guard.armed and not guard.interrupt(error)  # disarmed: nothing more is sent


def test_a_crossing_inside_one_long_native_call_is_raised_as_it_returns():
    guard = LiveGuard()
    sender = later(0.05, guard, crossing())
    started = time.monotonic()
    with pytest.raises(HostMemoryExceeded):
        guard.run(time.sleep, 0.4)  # C code: the interpreter raises when it is back in Python
    sender.join()
    assert time.monotonic() - started >= 0.39


def test_the_interrupt_never_lands_after_the_guarded_work():
    """Another thread interrupts as fast as it can while this one runs many short guarded calls, each followed by
    unguarded Python code: every interrupt is raised out of `run` (inside the work), none in the code after it."""
    guard, error, stop = LiveGuard(), crossing(), threading.Event()
    inside = outside = 0

    def pound():
        while not stop.is_set():
            guard.interrupt(error)  # why no pause: the lock is then often held as the work's run disarms

    def work():
        total = 0
        for i in range(300):
            total += i
        return total

    thread = threading.Thread(target=pound)
    thread.start()
    deadline = time.monotonic() + 1.5
    try:
        while time.monotonic() < deadline:
            try:
                guard.run(work)
            except HostMemoryExceeded:
                inside += 1
            try:
                total = 0
                for i in range(300):  # after the work: where a late interrupt would land
                    total += i
            except HostMemoryExceeded:
                outside += 1
    finally:
        stop.set()
        thread.join()
    assert outside == 0 and inside > 0, (inside, outside)


class Hog:
    """A reward function (or an optimizer step) that, when on, allocates host memory step by step up to `total`,
    recording how far it got; what it allocates lives in its frame only (freed when its phase is let go)."""

    def __init__(self, total: int = 768 * MiB):
        self.on, self.total, self.reached, self.finished = False, total, 0, False

    def allocate(self) -> None:
        if not self.on:
            return
        held, self.reached, self.finished = [], 0, False
        while self.reached < self.total:
            held.append(np.ones(STEP // 8))  # ones: the pages are touched, so RSS grows
            self.reached += STEP
            time.sleep(0.002)
        self.finished = True

    def __call__(self, prompts, completions, **kwargs):
        self.allocate()
        return [0.0 for _ in completions]


def budget_lab(tiny_config, **kwargs) -> tuple[Lab, object]:
    """A loaded tiny Lab held to a budget 256 MiB above what its process holds now (placement.host_memory_gib is
    fixed at load: its host reader's budget is set here, as the field sets it)."""
    lab = Lab(tiny_config(), **kwargs).load()
    reader = lab.memory.readers[0]
    reader.budget = reader.read()["rss"] + 256 * MiB
    return lab, reader


def state_of(lab):
    named = lab.learner.trainable_parameters()
    state = lab.learner.optimizer.state
    return (
        {n: p.detach().clone() for n, p in named.items()},
        {(n, k): v.clone() for n, p in named.items() for k, v in state.get(p, {}).items()},
    )


def assert_same_state(a, b):
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and x
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_an_allocation_loop_in_a_reward_function_is_stopped_at_the_line_and_the_lab_steps_again(tiny_config):
    hog = Hog()
    lab, reader = budget_lab(tiny_config, reward_funcs=["format", hog])
    try:
        lab.step()
        before, start = state_of(lab), reader.read()["used"]
        line = reader.budget * lab.memory.host_threshold
        hog.on = True
        with pytest.raises(HostMemoryExceeded) as caught:
            lab.step()
        message = str(caught.value)
        assert "\n" not in message and "during phase 'rewards' of step 1, no update had been applied" in message
        assert "(placement.host_memory_gib, this Lab's processes) (memory.host_threshold=0.95)" in message
        assert not hog.finished and hog.reached < (line - start) + BOUND, (hog.reached / MiB, (line - start) / MiB)
        row = next(r for r in lab.memory.rows_for(1, failed_attempts=True) if r["metric"] == "used")
        assert row["phase"] == "rewards" and line < row["peak"] < line + BOUND
        quoted = float(message.split("reached ")[1].split("%")[0]) / 100 * reader.budget
        assert quoted == pytest.approx(row["peak"], rel=2e-3)  # the line quotes the phase's peak, as the veto's does
        assert lab.current.rewards is None and lab.next_phase() == "rewards"  # the rewards were undone
        assert_same_state(before, state_of(lab))
        hog.on = False
        assert lab.step().step == 1 and len(lab.history) == 2  # the retry runs the rewards again, and the step ends
    finally:
        lab.close()


def test_a_crossing_after_the_update_is_undone_bit_for_bit(tiny_config, monkeypatch):
    """The optimizer phase applies the update, then allocates past the line: the guard stops it there, the update is
    rolled back (LoRA weights and AdamW state as before the step), and the same step runs again."""
    import grpo_lab.algo.grpo as step_module

    hog, real = Hog(), step_module.optimizer

    def update(learner, config):
        norm = real(learner, config)
        hog.allocate()
        return norm

    monkeypatch.setattr(step_module, "optimizer", update)
    lab, _ = budget_lab(tiny_config)
    try:
        lab.step()
        before = state_of(lab)
        hog.on = True
        with pytest.raises(HostMemoryExceeded, match=r"during phase 'optimizer' of step 1, the step's updates were"):
            lab.step()
        assert not hog.finished
        assert_same_state(before, state_of(lab))
        hog.on = False
        assert lab.step().step == 1
        after = state_of(lab)
        assert any(not torch.equal(before[0][k], after[0][k]) for k in before[0])  # this time the update is kept
    finally:
        lab.close()


def test_a_rollout_the_guard_stops_is_undone_with_its_random_draws(tiny_config, monkeypatch):
    """The rollout samples (its rows' seeds drawn from torch's generator), then allocates past the line: the guard
    stops it there, and the retry samples what a Lab that never failed samples (recovery/streams.py)."""
    import grpo_lab.algo.grpo as step_module

    hog, real = Hog(), step_module.rollout

    def sampled(*args, **kwargs):
        out = real(*args, **kwargs)
        hog.allocate()
        return out

    monkeypatch.setattr(step_module, "rollout", sampled)
    lab, _ = budget_lab(tiny_config)
    twin = Lab(tiny_config()).load()
    try:
        hog.on = True
        with pytest.raises(HostMemoryExceeded, match=r"during phase 'rollout' of step 0, no update had been applied"):
            lab.rollout()
        assert not hog.finished and lab.next_phase() == "rollout"
        hog.on = False
        got, expected = lab.rollout(), twin.rollout()
        assert got.batch.prompts == expected.batch.prompts
        assert torch.equal(got.completion_ids, expected.completion_ids)
        assert torch.equal(got.sampler_logprobs, expected.sampler_logprobs)
    finally:
        lab.close(), twin.close()


def test_without_the_live_guard_the_loop_runs_to_its_end_and_the_veto_fails_the_phase_as_it_ends(tiny_config):
    """The backstop, and what the live guard changes: with it off, the same loop allocates all it meant to, far past
    the line, and only then is the phase failed."""
    hog = Hog(total=512 * MiB)
    lab, reader = budget_lab(tiny_config, reward_funcs=["format", hog])
    try:
        lab.memory.live = None
        hog.on = True
        with pytest.raises(HostMemoryExceeded, match=r"during phase 'rewards' of step 0, no update had been applied"):
            lab.step()
        assert hog.finished and hog.reached == 512 * MiB
        hog.on = False
        assert lab.step().step == 0
    finally:
        lab.close()


class RisingHost:
    """A host reader whose used memory rises 1% of its 1 GiB limit at every reading once `on`: the phase runs on past
    the crossing while a native call holds the thread."""

    device, budget = "host", None

    def __init__(self):
        self.on, self.used = False, 0.5

    def read(self) -> dict:
        if self.on:
            self.used = min(self.used + 0.01, 1.2)
        return {"rss": self.used * 1024 * MiB, "used": self.used * 1024 * MiB, "limit": 1024 * MiB}


def test_the_stop_quotes_the_phases_peak_when_it_ran_on_past_the_crossing():
    """Inside one long native call the error lands as the call returns, the phase's memory rising meanwhile: its one
    line quotes the peak the phase's row records (the after-phase veto's figure), not the first reading over the
    line."""
    from grpo_lab.memory import MemorySampler
    from grpo_lab.memory.timeline import Timeline

    sampler = MemorySampler(["cpu"], hz=50, host_threshold=0.95, live=True)
    host = sampler.readers[0] = RisingHost()
    timeline = Timeline()
    timeline.listeners.append(sampler)
    sampler.start()
    try:
        with pytest.raises(HostMemoryExceeded) as caught:
            with timeline.phase("rewards", 0):
                host.on = True
                sampler.guarded(time.sleep, 0.5)  # C code: the interrupt waits for it to return
    finally:
        sampler.stop()
    row = next(r for r in sampler.phase_rows if r["metric"] == "used")
    quoted = float(str(caught.value).split("reached ")[1].split("%")[0]) / 100
    assert row["failed"] and quoted == pytest.approx(row["peak"] / (1024 * MiB), abs=1e-3)
    assert quoted >= 0.98 and "during phase 'rewards' of step 0" in str(caught.value)  # past the first crossing


def test_the_full_heads_buffers_past_the_room_left_are_refused_before_they_are_allocated():
    """One native call cannot be interrupted (the backward over the textbook head's [rows, vocab] logits): the head
    says their size first (algo/room.py) and the guarded phase's guard raises its one line there, nothing allocated;
    with room left, the same head runs."""
    from grpo_lab.algo.head import full_logprobs
    from grpo_lab.memory import MemorySampler

    sampler = MemorySampler(["cpu"], hz=0, host_threshold=0.95, live=True)
    reader = sampler.readers[0]
    rows, vocab = 512, 32_000  # 3 float32 [rows, vocab] buffers with a graph: 187.5 MiB
    hidden = torch.randn(rows, 16, requires_grad=True)
    weight, targets = torch.randn(vocab, 16), torch.randint(0, vocab, (rows,))
    reader.budget = (reader.read()["rss"] + 64 * MiB) / 0.95  # 64 MiB left under the line
    start = reader.read()["rss"]
    with pytest.raises(HostMemoryExceeded) as caught:
        sampler.guarded(full_logprobs, hidden, weight, None, targets, 1.0, 0)
    message = str(caught.value)
    assert message.startswith("host RAM would reach") and "\n" not in message
    assert "before the full head's 3 float32 [rows, vocab] buffers (188 MiB; " in message
    assert reader.read()["rss"] - start < 32 * MiB  # refused before the buffers were made
    reader.budget = (reader.read()["rss"] + 1024 * MiB) / 0.95
    assert sampler.guarded(full_logprobs, hidden, weight, None, targets, 1.0, 0).shape == (rows,)
    assert full_logprobs(hidden, weight, None, targets, 1.0, 0).shape == (rows,)  # unguarded: no check at all
