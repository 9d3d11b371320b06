"""Each rank's own memory budget (placement.rank_memory_gib) and P3's cleanup of a gathered generation that raised.

The guard's word on a rank is agreed by every rank: checked here with two real gloo processes running the Lab's phase
sequence (timeline, settle), one rank crossing its line; with real Ray ranks, a budget below what a rank holds stops
every rank before the phase, none restarted; and a gathered generation that raises on one rank leaves every rank's
layout as before, and the next step runs."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_lab import Lab, load_config
from grpo_lab.errors import LabError

pytestmark = [pytest.mark.solo, pytest.mark.xdist_group("ranks")]  # why solo: it starts ranks (gloo, Ray)

MiB, GiB = 1024**2, 1024**3
SHARDED = ["placement.learner_procs=2"]


# --- the field ---


@pytest.mark.parametrize(
    "sets, says",
    [
        (
            ["placement.rank_memory_gib=1"],
            "is each rank's budget in a sharded learner, and this learner is one process",
        ),
        ([*SHARDED, "placement.rank_memory_gib=0"], "greater than 0"),
        ([*SHARDED, "placement.rank_memory_gib=-2"], "greater than 0"),
    ],
    ids=["one-process", "zero", "negative"],
)
def test_a_rank_budget_is_positive_and_sharded_only_in_one_line(sets, says):
    with pytest.raises(LabError) as caught:
        load_config("tiny-cpu", sets)
    line = str(caught.value)
    assert line.startswith("placement.rank_memory_gib") and says in line and "\n" not in line, line


def test_cpu_rank_budgets_that_add_up_past_the_machine_are_refused_before_any_rank_starts(monkeypatch):
    from grpo_lab.memory.readers import HostReader
    from grpo_lab.preflight import check_host_budget

    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")  # Ray's monitor off: the machine's RAM is the line
    machine = HostReader().machine / GiB
    check_host_budget(load_config("tiny-cpu", [*SHARDED, f"placement.rank_memory_gib={machine / 2:.2f}"]))
    with pytest.raises(LabError) as caught:
        check_host_budget(load_config("tiny-cpu", [*SHARDED, f"placement.rank_memory_gib={machine:.1f}"]))
    line = str(caught.value)
    assert line.startswith("placement.rank_memory_gib: 2 CPU ranks x ") and "give each rank at most" in line
    with pytest.raises(LabError, match="hold each rank with placement.rank_memory_gib"):
        check_host_budget(load_config("tiny-cpu", [*SHARDED, "placement.host_memory_gib=1"]))


def test_a_gpu_rank_s_allocator_is_capped_at_its_budget_and_reports_it_as_its_capacity(monkeypatch):
    """(No GPU here: torch.cuda's two calls are stood in for; the cap's arithmetic and its call are what is checked.)"""
    from types import SimpleNamespace

    from grpo_lab.execution.sharded.rank_guard import cap_rank_gpu

    capped = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * GiB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: capped.append((f, d)))
    assert cap_rank_gpu(20, "cuda:0") == 20 * GiB and capped == [(0.25, "cuda:0")]
    assert cap_rank_gpu(100, "cuda:0") == 80 * GiB and capped[-1] == (1.0, "cuda:0")  # at most the card
    assert cap_rank_gpu(None, "cuda:0") is None and cap_rank_gpu(20, "cpu") is None and len(capped) == 2


# --- the driver's side ---


def test_a_rank_held_to_its_own_budget_sends_its_used_and_limit_and_the_others_do_not():
    from grpo_lab.execution.sharded.ranks import RankMemory

    memory = RankMemory(["cpu"], 0, 0.95)
    sample = lambda metric, value: (0.0, 0, "rollout", "host", metric, value)
    row = lambda metric: {"step": 0, "phase": "rollout", "device": "host", "metric": metric, "peak": 1.0}
    delta = {"wall0": memory.wall0, "samples": [sample(m, 1.0) for m in ("rss", "used", "limit")]}
    memory.ingest(0, {**delta, "rows": [row("rss"), row("used")], "own_host": False})
    memory.ingest(1, {**delta, "rows": [row("rss"), row("used")], "own_host": True})
    assert {(d, m) for _, _, _, d, m, _ in memory.samples} == {
        ("rank0/host", "rss"),
        *(("rank1/host", m) for m in ("rss", "used", "limit")),
    }
    assert {(r["device"], r["metric"]) for r in memory.phase_rows} == {
        ("rank0/host", "rss"),
        ("rank1/host", "rss"),
        ("rank1/host", "used"),
    }


def test_the_driver_names_the_rank_that_failed_not_a_peer_that_stopped_with_it():
    from grpo_lab.execution.sharded.ranks import first_failed

    notes = lambda peer: {"boundary": None, "blocked": False, "peer": peer}
    replies = {
        0: ("error", "rollout failed on rank 1", {}, notes(True)),
        1: ("error", "rank 1's ...", {}, notes(False)),
    }
    assert first_failed(replies) == 1
    assert first_failed({0: ("error", "a", {}, notes(False)), 1: ("error", "b", {}, notes(False))}) == 0
    assert first_failed({0: ("ok", None, {}, notes(False)), 1: ("died", "its process died")}) == 1


# --- the guard's word, agreed: two gloo processes, rank 1 over its line ---


def _phase(timeline, name: str, work) -> str:
    """A phase as the Lab runs it (lab._phase): the body, settle, and on failure the agreed branch."""
    from grpo_lab.runtime import settle

    try:
        with timeline.phase(name, 0):
            work()
            settle(name, failed=False)
    except Exception as err:
        if not getattr(err, "agreed", False):
            settle(name, failed=True)
        return f"{type(err).__name__}: {err}"
    return "ok"


def _guarded_ranks(rank: int, size: int, out: str) -> None:
    """Each rank's RankGuard in a Timeline; rank 1's line 100 MiB over its RSS now, rank 0's far away."""
    from grpo_lab.execution.sharded.rank_guard import RankGuard
    from grpo_lab.memory.readers import HostReader
    from grpo_lab.memory.timeline import Timeline
    from grpo_lab.runtime import init_decisions

    init_decisions()
    rss = HostReader().read()["rss"]
    budget = (rss + 100 * MiB) / 0.95 if rank == 1 else HostReader().machine / 2
    guard = RankGuard(["cpu"], 0, 0.95, host_budget=budget)  # hz 0: phase boundary readings only
    timeline, held = Timeline(), []
    timeline.listeners.append(guard)
    mine = lambda fn: lambda: fn() if rank == 1 else None
    hold = mine(lambda: held.append(torch.ones(300 * MiB // 4)))  # 300 MiB resident, past rank 1's line

    def fail_on_rank_0():
        if rank == 0:
            raise RuntimeError("rank 0's own failure")
        hold()

    results = {"rollout": _phase(timeline, "rollout", hold)}  # rank 1 crosses inside the phase
    held.clear()
    results["rewards"] = _phase(timeline, "rewards", lambda: None)  # freed: both run
    hold()  # rank 1 crosses between phases: the next phase is stopped before it starts, on every rank
    results["advantages"] = _phase(timeline, "advantages", lambda: None)
    held.clear()
    results["logprobs"] = _phase(timeline, "logprobs", lambda: None)
    results["backward"] = _phase(timeline, "backward", fail_on_rank_0)  # an error and a crossing: one decision
    held.clear()
    results["optimizer"] = _phase(timeline, "optimizer", lambda: None)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(results, f)


@pytest.mark.timeout(120)
def test_a_phase_one_rank_s_guard_fails_fails_on_every_rank_at_its_end_or_its_start(tmp_path):
    from test_sharded_load import run_ranks

    run_ranks(_guarded_ranks, str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1))
    assert r1["rollout"].startswith("HostMemoryExceeded: rank 1's process reached ")
    assert "(placement.rank_memory_gib; memory.host_threshold=0.95); during phase 'rollout' of step 0" in r1["rollout"]
    assert r0["rollout"].startswith("PeerFailed: rollout failed on rank 1: its process crossed its memory line")
    assert r0["rewards"] == r1["rewards"] == "ok"
    assert "stopped before phase 'advantages' of step 0" in r1["advantages"]
    assert r0["advantages"].startswith("PeerFailed: advantages failed on rank 1")
    assert r0["logprobs"] == r1["logprobs"] == "ok"
    assert r0["backward"] == "RuntimeError: rank 0's own failure" and r1["backward"].startswith("PeerFailed")
    assert r0["optimizer"] == r1["optimizer"] == "ok"  # nobody was left in a collective


# --- real Ray ranks ---


@pytest.mark.slow
@pytest.mark.cores(2)
def test_ranks_over_their_own_budget_stop_together_before_the_phase_and_none_restarts(ray_local, tiny_model):
    from grpo_lab.memory.report import capacities_of
    from grpo_lab.ui.story import budget_line

    lab = Lab("tiny-cpu", overrides=[f"model.name_or_path={tiny_model}", *SHARDED, "placement.rank_memory_gib=0.3"])
    lab.load()
    try:
        pids = list(lab.executor.ranks.pids)
        assert capacities_of(lab.memory)["rank1/host"] == 0.3 * GiB
        assert budget_line(lab, "rank1/host") == pytest.approx(0.3 * 1024 * 0.95)
        before = lab.inspect()
        with pytest.raises(LabError) as caught:
            lab.rollout()
        line = str(caught.value)
        assert line.startswith("rollout failed on rank 0: rank 0's process reached ") and "\n" not in line, line
        assert "of its 0.30 GiB (placement.rank_memory_gib" in line and "stopped before phase 'rollout'" in line
        assert lab.executor.ranks.pids == pids  # decided together: no rank restarted
        after = lab.inspect()
        assert [a["step"] for a in after] == [b["step"] for b in before] == [0, 0]
        # each rank's own `used` (its RSS) reached the driver, over its line
        used = [s for s in lab.memory.samples if s[3] == "rank1/host" and s[4] == "used"]
        assert used and max(s[5] for s in used) > 0.3 * GiB * 0.95
    finally:
        lab.close()


@pytest.mark.slow
@pytest.mark.cores(2)
def test_a_gathered_generation_that_raises_on_one_rank_leaves_every_rank_s_layout_and_the_next_step_runs(
    ray_local, tiny_model
):
    """Rank 1 alone raises inside generate, its units gathered whole: rank 0 is then inside a collective of the same
    generate (transformers' synced_gpus), so no decision can reach it; every rank is restarted from the step's start
    (P3's `finally` ran on rank 1 before its process went). Every rank's layout is as before, and the step runs."""
    lab = Lab("tiny-cpu", overrides=[f"model.name_or_path={tiny_model}", *SHARDED]).load()
    try:
        before, pids = lab.inspect(), list(lab.executor.ranks.pids)
        lab.arm_fault(1, "rollout", "runtime")
        with pytest.raises(LabError) as caught:
            lab.rollout()
        line = str(caught.value)
        assert line.startswith("rollout failed on rank 1: RuntimeError: injected failure in rollout"), line
        assert "every rank was restarted" in line and "\n" not in line
        assert lab.executor.ranks.pids != pids
        after = lab.inspect()
        for b, a in zip(before, after):
            assert a["layout"] == b["layout"] and all(a["layout"]["sharded"]) and not a["layout"]["iteration_open"]
        result = lab.step()
        assert result.step == 0 and result.attempts >= 1  # the failed rollout is filed as an attempt of step 0
    finally:
        lab.close()


# --- Ray's own kill line (P4): its memory monitor kills a worker mid-phase, before a rank's guard could stop it ---


def test_cpu_rank_budgets_past_rays_kill_line_are_refused_naming_the_budget_that_fits():
    from grpo_lab.preflight import RayLine, check_ray_line

    place = load_config("tiny-cpu", SHARDED).placement
    line = RayLine(share=0.5, machine_gib=24.0, used_gib=2.0)  # Ray kills above 12 GiB; 10 GiB left for 2 ranks
    assert line.gib == 12.0 and line.room_per_rank(2) == 5.0
    check_ray_line(place.model_copy(update={"rank_memory_gib": 5.0}), line)
    with pytest.raises(LabError) as caught:
        check_ray_line(place.model_copy(update={"rank_memory_gib": 5.01}), line)
    said = str(caught.value)
    assert (
        said.startswith("placement.rank_memory_gib: 2 CPU ranks x 5.01 GiB on top of the 2.00 GiB") and "\n" not in said
    )
    assert "Ray's kill line, 12.00 GiB (RAY_memory_usage_threshold 0.5 of 24.0 GiB)" in said
    assert said.endswith("give each rank at most 5.00 GiB")


def test_the_lab_reads_rays_kill_line_where_a_ray_started_here_reads_it(monkeypatch):
    """RAY_memory_usage_threshold (Ray's default 0.95), off with RAY_memory_monitor_refresh_ms=0; checked with the
    rank budgets before any rank starts, on this machine's figures."""
    from grpo_lab.checks.world import ray_kill_share
    from grpo_lab.preflight import RayLine, check_host_budget

    monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    monkeypatch.delenv("RAY_memory_monitor_refresh_ms", raising=False)
    assert ray_kill_share() == 0.95
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.4")
    assert ray_kill_share() == 0.4 and RayLine.now().share == 0.4
    over = RayLine.now().machine_gib * 0.3  # two ranks: 60 % of the machine, past a 40 % line
    with pytest.raises(LabError, match="pass Ray's kill line"):
        check_host_budget(load_config("tiny-cpu", [*SHARDED, f"placement.rank_memory_gib={over:.2f}"]))
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    assert ray_kill_share() is None
    check_host_budget(load_config("tiny-cpu", [*SHARDED, f"placement.rank_memory_gib={over:.2f}"]))


@pytest.mark.parametrize("value", ["1.3", "0", "-0.1", "ninety", "nan"])
def test_a_kill_share_ray_cannot_start_with_is_one_line_before_ray_times_out_on_it(monkeypatch, value):
    """Ray started with RAY_memory_usage_threshold=1.3 only timed out ("the current node timed out during startup",
    seen): refused in one line naming the variable, with or without rank budgets."""
    from grpo_lab.preflight import check_host_budget

    monkeypatch.setenv("RAY_memory_usage_threshold", value)
    with pytest.raises(LabError) as caught:
        check_host_budget(load_config("tiny-cpu", SHARDED))
    said = str(caught.value)
    assert said.startswith(f"RAY_memory_usage_threshold={value!r}: ") and "(0, 1]" in said and "\n" not in said
