"""One line for the plan and the guard (issue 68): host RAM is planned against memory.host_threshold of its capacity,
the line where the host guard stops a phase, so a planned host peak past it is "does not fit", never "fits" or
"tight"; the plan prints that line, and `grpo-lab run` and preflight refuse with it."""

from __future__ import annotations

import pytest

from grpo_lab import load_config
from grpo_lab.errors import LabError
from grpo_lab.planner import plan
from grpo_lab.planner.estimate import DevicePlan

pytestmark = pytest.mark.usefixtures("tiny_model")

GiB, MiB = 1024**3, 1024**2
BASE = ["model.name_or_path=builtin:tiny-random"]


def at_share(share: float, *more: str):
    """tiny-cpu with a host budget that puts its planned host peak at `share` of it."""
    peak = plan(load_config("tiny-cpu", BASE)).devices["host"].total
    return load_config("tiny-cpu", [*BASE, f"placement.host_memory_gib={peak / share / GiB}", *more])


def test_97_percent_of_capacity_with_a_95_percent_guard_does_not_fit():
    result = plan(at_share(0.97))
    host = result.devices["host"]
    assert round(host.fraction, 3) == 0.97 and host.line == 0.95
    assert not host.fits and not result.fits and [d.device for d in result.failing()] == ["host"]
    assert host.verdict == "does not fit (over the guard's line, 95% of capacity)"
    text = str(result)
    assert "-> fits" not in text and "tight" not in text and "verdict: does not fit on host" in text
    line = next(row for row in text.splitlines() if row.strip().startswith("guard's line"))
    assert f"{host.capacity * 0.95 / MiB:.1f} MiB" in line and "memory.host_threshold 0.95" in line


def test_the_same_peak_under_a_higher_line_fits_tightly_and_far_under_it_fits():
    assert plan(at_share(0.97, "memory.host_threshold=0.99")).devices["host"].verdict.startswith("tight")
    relaxed = plan(at_share(0.5))
    assert relaxed.fits and relaxed.devices["host"].verdict == "fits" and str(relaxed).endswith("verdict: fits")


def test_tight_is_within_ten_percent_under_the_line_and_a_gpu_keeps_its_whole_capacity():
    host = DevicePlan("host", capacity=1000, line=0.95)
    host.add("weights", 870)  # 87%: over 0.9 x 0.95, under the line
    assert host.fits and host.verdict.startswith("tight")
    gpu = DevicePlan("cuda:0", capacity=1000)
    gpu.add("weights", 970)  # a GPU has no guard's line: 97% is tight, and fits
    assert gpu.line == 1.0 and gpu.fits and gpu.verdict.startswith("tight")


def test_the_runner_refuses_a_plan_over_the_line_and_names_it():
    from grpo_lab.runner import check_plan

    with pytest.raises(LabError) as caught:
        check_plan(at_share(0.97))
    message = str(caught.value)
    assert "does not fit on host" in message and "the guard's line: 95% of" in message and "\n" not in message


def test_a_cpu_ranks_budget_is_judged_at_its_guards_line():
    """A CPU rank's own guard stops it at memory.host_threshold of placement.rank_memory_gib: the plan judges it so."""
    from grpo_lab.planner.sharded import rank_lines

    config = load_config("tiny-cpu", [*BASE, "placement.learner_procs=2"])
    peak = plan(config).ranks["host (rank 0)"].total
    held = plan(load_config(config, [f"placement.rank_memory_gib={peak / 0.97 / GiB}"]))
    rank = held.devices["host (rank 0)"]
    assert rank.line == 0.95 and not rank.fits and "over the guard's line" in rank.verdict
    line = rank_lines(held)["host (rank 0)"]
    assert not line["fits"] and line["line_mib"] == pytest.approx(line["capacity_mib"] * 0.95)


def test_a_frontier_cell_over_the_guards_line_does_not_fit_and_has_no_headroom():
    from grpo_lab.planner import frontier

    config = at_share(0.97)
    length, generations = config.generator.max_completion_length, config.grpo.num_generations
    front = frontier(config, lengths=[length], generations=[generations])
    cell = front.cell(*front.current)
    assert not cell.fits and cell.device == "host" and cell.headroom < 0 and cell.short() == "NO 97%"
