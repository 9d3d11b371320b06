"""placement.host_memory_gib below this machine's RAM is held as a cgroup limit would be: the host reader's limit is
the budget and its used this process tree's RSS, the guard stops the next phase in one line naming the field, and a
sharded learner (whose ranks are outside this process tree) refuses such a budget; a budget at or above the
machine's RAM leaves the machine's figures."""

from __future__ import annotations

import psutil
import pytest

from grpo_lab import Lab, load_config
from grpo_lab.errors import ConfigError, LabError
from grpo_lab.memory import MemorySampler
from grpo_lab.memory.readers import HostReader, MiB, host_budget, readers_for
from grpo_lab.memory.report import host_limits
from grpo_lab.memory.sampler import HostMemoryExceeded
from grpo_lab.preflight import check_host_budget, preflight

pytestmark = pytest.mark.xdist_group("host_budget")  # why: its Lab tests share module-scoped Labs

GiB = 1024**3


def machine_ram() -> int:
    """What a budget is compared with: the cgroup's limit, else the host's RAM (as HostReader reads it)."""
    reader = HostReader()
    return reader.limit if reader.limit is not None else psutil.virtual_memory().total


def test_a_budget_below_the_machine_is_the_limit_and_used_is_this_process_trees_rss():
    reader = HostReader(budget=512 * MiB)
    assert reader.budget == 512 * MiB
    before = psutil.Process().memory_info().rss
    reading = reader.read()
    after = psutil.Process().memory_info().rss
    assert reading["limit"] == 512 * MiB
    assert reading["used"] == reading["rss"]
    assert before - 64 * MiB <= reading["rss"] <= after + 64 * MiB  # this process (no children here)


@pytest.mark.parametrize("times", [1.0, 4.0])
def test_a_budget_at_or_above_the_machine_is_ignored(times):
    reader = HostReader(budget=times * machine_ram())
    assert reader.budget is None
    reading = reader.read()
    assert reading["limit"] == machine_ram()
    if reader.limit is None:  # no cgroup limit: used is the machine's (total - available), not this process's RSS
        # (read around a second reading: the tests beside this one move the machine's figure between the two)
        before = psutil.virtual_memory()
        used = reader.read()["used"]
        after = psutil.virtual_memory()
        around = [vm.total - vm.available for vm in (before, after)]
        assert min(around) - 256 * MiB < used < max(around) + 256 * MiB
        assert reading["used"] != reading["rss"]


def write_cgroup_v2(root, limit: int, usage: int, inactive: int):
    (root / "memory.max").write_text(f"{limit}\n")
    (root / "memory.current").write_text(f"{usage}\n")
    (root / "memory.stat").write_text(f"anon 1000\ninactive_file {inactive}\n")
    return root


def test_under_a_cgroup_limit_the_budget_is_compared_with_the_cgroups_limit(tmp_path):
    """A cgroup of 1 GiB (a machine smaller than the host's RAM): 2 GiB is above it (ignored, the cgroup's figures),
    512 MiB below it (held)."""
    write_cgroup_v2(tmp_path, limit=1 * GiB, usage=900 * MiB, inactive=600 * MiB)
    above = HostReader(cgroup_root=tmp_path, budget=2 * GiB)
    assert above.budget is None and above.read()["limit"] == 1 * GiB and above.read()["used"] == 300 * MiB
    below = HostReader(cgroup_root=tmp_path, budget=512 * MiB)
    reading = below.read()
    assert below.budget == 512 * MiB and reading["limit"] == 512 * MiB and reading["used"] == reading["rss"]


def test_host_budget_is_the_field_in_bytes_and_readers_for_hands_it_to_the_host_reader():
    assert host_budget(load_config("tiny-cpu")) is None
    assert host_budget(load_config("tiny-cpu", ["placement.host_memory_gib=0.5"])) == 0.5 * GiB
    held = readers_for(["cpu"], 256 * MiB)
    assert len(held) == 1 and held[0].device == "host" and held[0].budget == 256 * MiB
    assert readers_for(["cpu", "cpu"])[0].budget is None


def test_the_guard_holds_a_small_budget_and_names_the_field():
    """1 MiB at threshold 0.95: this process's RSS is far above it, so the next phase does not start."""
    sampler = MemorySampler(["cpu"], hz=0, host_threshold=0.95, host_budget=1 * MiB)
    reading = sampler.read()
    assert reading[("host", "limit")] == 1 * MiB and reading[("host", "used")] == reading[("host", "rss")]
    assert host_limits(sampler)["host limit"] == 1.0  # the plots draw the budget, in MiB
    with pytest.raises(HostMemoryExceeded) as caught:
        sampler.check_host(3, "backward")
    message = str(caught.value)
    assert "placement.host_memory_gib" in message and "of 0.00 GiB" in message
    assert "stopped before phase 'backward' of step 3" in message


def test_the_plots_draw_the_line_each_budgeted_rank_is_held_to():
    """Notebook 06's figures showed only 'off the scale: host limit' while its story was each rank's budget: a rank
    with placement.rank_memory_gib gets its guard's line (memory.host_threshold of the budget), drawn once for the
    ranks that share it; an unbudgeted rank, whose host is this machine's, draws nothing of its own."""
    sampler = MemorySampler(["cpu"], hz=0, host_threshold=0.95)
    sampler.rank_capacities = {"rank0/host": 1024 * MiB, "rank1/host": 1024 * MiB, "rank2/host": 10 * machine_ram()}
    limits = host_limits(sampler)
    assert limits["rank0, rank1 line (95% of its budget)"] == pytest.approx(0.95 * 1024)
    assert not [name for name in limits if "rank2" in name]
    assert "host limit" in limits  # the machine's own, as before


def test_without_a_budget_or_with_a_huge_one_the_guard_reads_the_machine():
    """A machine far from full passes at 0.95; at a threshold it is over, the line does not name the budget."""
    for budget in (None, 10 * machine_ram()):
        sampler = MemorySampler(["cpu"], hz=0, host_threshold=0.95, host_budget=budget)
        assert sampler.readers[0].budget is None
        sampler.check_host(0, "rollout")
        sampler.host_threshold = 1e-6
        with pytest.raises(HostMemoryExceeded) as caught:
            sampler.check_host(0, "rollout")
        assert "placement.host_memory_gib" not in str(caught.value)


def sharded(*overrides):
    return load_config("tiny-cpu", ["placement.learner_procs=2", *overrides])


def test_a_sharded_learner_refuses_a_budget_below_the_machine_in_one_line(tiny_model, monkeypatch):
    monkeypatch.setattr("grpo_lab.checks.world.usable_cpus", lambda: 2)  # why: on 1 core the cores' line came first
    with pytest.raises(LabError) as caught:
        check_host_budget(sharded("placement.host_memory_gib=4"))
    line = str(caught.value)
    assert line.startswith("placement.host_memory_gib: 4.0 GiB is below this machine's RAM") and "\n" not in line
    assert "placement.learner_procs: 1" in line
    with pytest.raises(LabError, match=r"^placement\.host_memory_gib:"):
        preflight(sharded("placement.host_memory_gib=4"))  # before any rank starts


def test_a_sharded_learner_accepts_no_budget_or_one_above_the_machine(tiny_model):
    check_host_budget(sharded())
    check_host_budget(sharded(f"placement.host_memory_gib={10 * machine_ram() / GiB:.0f}"))
    preflight(load_config("tiny-cpu", ["placement.host_memory_gib=4"]))  # one process: the guard holds it


@pytest.fixture(scope="module")
def budget_lab(tiny_model):
    """tiny-cpu on the random tiny model, held to 0.3 GiB (below this process's RSS)."""
    lab = Lab("tiny-cpu", overrides=["model.name_or_path=builtin:tiny-random", "placement.host_memory_gib=0.3"]).load()
    yield lab
    lab.close()


def test_a_lab_over_its_budget_stops_before_the_first_phase_in_one_line(budget_lab):
    assert budget_lab.memory.readers[0].budget == 0.3 * GiB
    with pytest.raises(LabError) as caught:
        budget_lab.step()
    line = str(caught.value)
    assert "\n" not in line
    assert "of 0.30 GiB (placement.host_memory_gib, this Lab's processes)" in line
    assert "stopped before phase 'rollout' of step 0" in line
    assert not budget_lab.history


def test_the_threshold_cannot_be_raised_past_the_budget_and_a_lab_without_one_steps(budget_lab):
    """memory.host_threshold is at most 1.0, so a budget below the Lab's RSS cannot be waved through; the same
    config without the budget steps."""
    with pytest.raises(ConfigError, match="memory.host_threshold"):
        budget_lab.config.memory.host_threshold = 50.0
    assert budget_lab.memory.host_threshold == 0.95
    with pytest.raises(LabError, match="placement.host_memory_gib"):
        budget_lab.step()  # still held
    free = Lab("tiny-cpu", overrides=["model.name_or_path=builtin:tiny-random", "run.steps=1"]).load()
    try:
        assert free.memory.readers[0].budget is None
        free.step()
        assert len(free.history) == 1
    finally:
        free.close()


def test_a_phase_that_crosses_the_budget_is_undone_and_the_retry_runs_it_again():
    """Issue 51: the guard fails the phase that crossed the line as it ends, and the step goes back to before it, its
    output included, so the retry runs that phase again (as a real out-of-memory would force) with what the user
    changed. Here the first rollout holds 400 MiB more than the budget leaves: it is failed, not kept; the retry (the
    user "fixed" it: the hog is off) samples again, and the step finishes on the second rollout."""
    import numpy as np

    lab = Lab("tiny-cpu", overrides=["model.name_or_path=builtin:tiny-random"]).load()
    try:
        reader = lab.memory.readers[0]
        reader.budget = reader.read()["rss"] + 300 * MiB  # (placement.host_memory_gib is fixed at load; its reader)
        generator, calls, hog = lab.generator, [], {"on": True}
        real = generator.generate

        def generate(*args, **kwargs):
            calls.append(hog["on"])
            held = np.ones(400 * MiB // 8) if hog["on"] else None
            lab.memory.read()  # a sample while it is held (the sampler's thread may not tick in time)
            del held
            return real(*args, **kwargs)

        generator.generate = generate
        with pytest.raises(HostMemoryExceeded) as caught:
            lab.step()
        assert "during phase 'rollout' of step 0" in str(caught.value)
        assert lab.current.rollout is None and lab.next_phase() == "rollout"  # the rollout was undone
        hog["on"] = False
        result = lab.step()
        assert calls == [True, False] and result.step == 0  # the retry ran the rollout again
        rollouts = [r for r in lab.memory.phase_rows if r["phase"] == "rollout" and r["metric"] == "used"]
        assert [r["failed_attempt"] is not None for r in rollouts] == [True, False]
        assert rollouts[0]["peak"] > reader.budget * lab.memory.host_threshold > rollouts[1]["peak"]
    finally:
        lab.close()
