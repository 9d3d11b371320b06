"""A phase's and a mark's host peak is the kernel's, not only the highest sample: a spike between two readings (a
prefill's activations, freed before the sampler's thread runs again on a loaded machine) is in the peak, from the
process's VmHWM reset at every phase start and mark. Where the kernel offers no resettable peak, the samples alone."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from grpo_lab.memory.readers import HostReader, MiB
from grpo_lab.memory.sampler import MemorySampler

SPIKE = 256 * MiB


def spike() -> None:
    """SPIKE bytes made resident and freed again, with no reading in between (numpy's large arrays are mmapped:
    freeing one unmaps it, so the RSS drops at once)."""
    block = np.ones(SPIKE // 8)
    del block


def sampled_without_thread(budget=None) -> MemorySampler:
    # hz 0: readings at phase starts, marks and ends only, so a spike inside a mark is never sampled
    return MemorySampler(["cpu"], hz=0, host_threshold=0.95, host_budget=budget)


def run_marks(sampler: MemorySampler) -> dict:
    """One phase with two marks: `turn 1` spikes, `turn 2` does not; returns {mark: peak rss}, the phase's row."""
    sampler.phase_started(0, "rollout")
    sampler.mark("turn 1")
    spike()
    sampler.mark("turn 2")
    sampler.phase_ended(SimpleNamespace(step=0, phase="rollout"), None)
    peaks = {m["mark"]: m["peak"] for m in sampler.segments}
    row = next(r for r in sampler.phase_rows if r["metric"] == "rss")
    return dict(peaks=peaks, row=row)


def test_a_spike_between_readings_is_in_its_marks_and_its_phases_peak():
    sampler = sampled_without_thread()
    if not sampler.readers[0].exact:
        pytest.skip("this kernel offers no resettable peak RSS (/proc/self/clear_refs)")
    seen = run_marks(sampler)
    turn1, turn2 = seen["peaks"]["turn 1"][("host", "rss")], seen["peaks"]["turn 2"][("host", "rss")]
    start = seen["row"]["start"]
    assert seen["row"]["peak"] >= start + 0.9 * SPIKE, (seen["row"]["peak"] - start) / MiB
    assert turn1 >= start + 0.9 * SPIKE and turn2 < turn1 - 0.5 * SPIKE, (turn1 - start) / MiB  # reset at the mark


def test_under_a_budget_the_guards_used_peak_is_exact_and_its_backstop_sees_the_spike():
    base = HostReader().read()["rss"]
    sampler = sampled_without_thread(budget=base + SPIKE / 2)  # a line the spike crosses, the idle process not
    if not sampler.readers[0].exact:
        pytest.skip("this kernel offers no resettable peak RSS (/proc/self/clear_refs)")
    sampler.phase_started(0, "rollout")
    spike()
    vetoed = sampler.phase_ended(SimpleNamespace(step=0, phase="rollout"), None)
    assert vetoed is not None and "during phase 'rollout' of step 0" in str(vetoed)


def test_where_the_peak_cannot_be_reset_the_samples_alone_make_it(monkeypatch, tmp_path):
    denied = tmp_path / "clear_refs"
    denied.mkdir()  # why a folder: writing to it fails as a kernel without the file or the right would
    monkeypatch.setattr("grpo_lab.memory.readers.CLEAR_REFS", denied)
    sampler = sampled_without_thread()
    seen = run_marks(sampler)
    assert not sampler.readers[0].exact and sampler.readers[0].peak() == {}
    assert seen["row"]["peak"] < seen["row"]["start"] + 0.5 * SPIKE  # only the readings at the marks: none in it


def test_a_reader_made_while_a_phase_runs_leaves_its_peak_as_it_was():
    """The planner and preflight make host readers of their own (the machine's RAM, a budget): one made inside a phase
    must not restart the peak the phase's sampler reads."""
    sampler = sampled_without_thread()
    sampler.phase_started(0, "rollout")
    if not sampler.readers[0].exact:
        pytest.skip("this kernel offers no resettable peak RSS (/proc/self/clear_refs)")
    spike()
    HostReader()  # (what planner/parts.py does for the machine's RAM)
    sampler.phase_ended(SimpleNamespace(step=0, phase="rollout"), None)
    row = next(r for r in sampler.phase_rows if r["metric"] == "rss")
    assert row["peak"] >= row["start"] + 0.9 * SPIKE, (row["peak"] - row["start"]) / MiB
