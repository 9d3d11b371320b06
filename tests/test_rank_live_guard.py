"""A CPU rank's live guard under Ray (issue 68, item 1): while a phase's work runs on a rank held to
placement.rank_memory_gib, the rank's sampler stops it where the rank's RSS crosses memory.host_threshold of its budget
(not as the phase ends), so the rank stops before Ray's memory monitor, whose line the budgets sit under, kills it.
Every rank undoes the step, none restarts, the driver names the rank and the phase in one line, and the step runs
again. Real Ray ranks; the crossing is a reward function allocating on rank 1 (tests/memory_hog.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from grpo_lab import Lab
from grpo_lab.errors import LabError

pytestmark = [pytest.mark.solo, pytest.mark.xdist_group("ranks")]  # why solo: it starts Ray and rank processes

MiB, GiB = 1024**2, 1024**3
BUDGET_GIB = 1.25  # each rank's budget: a tiny rank idles near 0.7 GiB, so its 95% line leaves a few hundred MiB
BOUND = 96 * MiB  # how far past the line the rank may get before it is stopped (a few 8 MiB steps, a loaded machine)
HOG_TOTAL = 1024 * MiB  # what the reward function means to allocate (memory_hog.HOG_TOTAL): far past the line


@pytest.fixture
def ray_with_tests_on_path(monkeypatch):
    """A local Ray whose workers import tests/memory_hog.py (data.rewards names it), shut down after the test."""
    import ray

    from grpo_lab.execution.sharded.ray_cluster import start_local

    if ray.is_initialized():
        ray.shutdown()
    tests = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    start_local(cpus=2)  # (the raylet, and the rank workers it starts, inherit this environment)
    yield ray
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.cores(2)
def test_a_rank_crossing_its_line_mid_phase_is_stopped_there_and_every_rank_undoes_the_step(
    ray_with_tests_on_path, tiny_model
):
    lab = Lab(
        "tiny-cpu",
        overrides=[
            f"model.name_or_path={tiny_model}",
            "placement.learner_procs=2",
            f"placement.rank_memory_gib={BUDGET_GIB}",
            "data.rewards=[format,memory_hog:once_on_rank_1]",
        ],
    ).load()
    try:
        pids, before = list(lab.executor.ranks.pids), lab.inspect()
        line = BUDGET_GIB * GiB * lab.config.memory.host_threshold
        with pytest.raises(LabError) as caught:
            lab.step()
        said = str(caught.value)
        assert said.startswith("rewards failed on rank 1: rank 1's process reached ") and "\n" not in said, said
        assert f"of its {BUDGET_GIB:.2f} GiB (placement.rank_memory_gib; memory.host_threshold=0.95)" in said
        assert "during phase 'rewards' of step 0" in said
        # stopped at the line, in the phase: the failed attempt's peak is past the line by a few steps at most, where
        # the reward function, run to its end, would have gone HOG_TOTAL past where it began
        row = next(
            r
            for r in lab.memory.rows_for(0, failed_attempts=True)
            if r["device"] == "rank1/host" and r["metric"] == "used" and r["phase"] == "rewards"
        )
        assert line < row["peak"] < line + BOUND, (row["peak"] / MiB, line / MiB)
        assert row["start"] + HOG_TOTAL > line + 2 * BOUND  # (so the bound above is not met by the loop's end)
        # decided together: no rank restarted, every rank still at step 0, the step runs again to its end
        assert lab.executor.ranks.pids == pids
        assert [a["step"] for a in lab.inspect()] == [b["step"] for b in before] == [0, 0]
        assert lab.next_phase() == "rewards"
        assert lab.step().step == 0 and len(lab.history) == 1
    finally:
        lab.close()
