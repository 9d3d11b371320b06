"""Notebook 06's story, executed under papermill with its defaults on CPU ranks: each rank holds a budget of its own
(placement.rank_memory_gib); a 16-bit model's rollout gathered whole crosses it, is stopped and undone on every rank;
generating layer by layer runs the same step under it; the plan says so per rank first. P4 as it happens on Ray: its
memory monitor, its threshold set low, kills a rank of the textbook log-prob head mid-backward; held to their share of
Ray's line, the ranks run the chunked head's step to its end under it. The notebook's other sections (a step on two
ranks, the driver's RSS explained, P3's cleanup after a failed generation, P5, a rank's OOM and death) keep their
facts. The tiny model of the suite stands in for the trained one (not trained here: minutes)."""

import pytest
from test_notebook_stories import NOTEBOOKS, check_prose, check_static_figures
from test_notebooks import ROOT, printed, run_notebook

from grpo_lab.ui.story import facts_in

# why alone: it starts Ray and rank processes, and sets Ray's kill line just above what the machine uses as P4 starts
pytestmark = [pytest.mark.solo, pytest.mark.cores(2), pytest.mark.alone]

NAME = "06_sharded_learner.ipynb"


@pytest.fixture(scope="module")
def story(tiny_model, tmp_path_factory):
    nb = run_notebook(NOTEBOOKS / NAME, tmp_path_factory.mktemp("06") / NAME, ROOT, {"model_path": tiny_model})
    return nb, facts_in(nb)


@pytest.mark.slow
def test_06_a_gathered_rollout_crosses_its_rank_s_line_and_layer_by_layer_runs_under_it(story):
    nb, facts = story
    line = facts["rank_budget_gib"] * 1024 * 0.95  # the guard's line on every rank (memory.host_threshold 0.95)
    failing, fixed = facts["failing"], facts["fixed"]
    # the plan, per rank: the gathered rollout is each rank's peak and over its budget; layer by layer fits
    for rank in facts["planned"]["gathered"].values():
        assert (
            rank["phase"] == "rollout" and not rank["fits"] and rank["capacity_mib"] == facts["rank_budget_gib"] * 1024
        )
    assert all(rank["fits"] for rank in facts["planned"]["layered"].values())
    # gathered: stopped by the rank's live guard as it crossed, in one line naming the rank and the field, at that
    # rank's line (the live guard: within a few MiB of it, not the phase's end)
    stopped = failing["stopped"]
    assert stopped and stopped.startswith("rollout failed on rank ") and "\n" not in stopped, failing
    assert "(placement.rank_memory_gib; memory.host_threshold=0.95); during phase 'rollout' of step 0" in stopped
    named = f"rank{stopped.split()[4].rstrip(':')}/host"  # 'rollout failed on rank K: ...'
    per_rank = facts["failing_per_rank"]
    assert named in per_rank and set(per_rank) <= {"rank0/host", "rank1/host"}
    assert per_rank[named]["over"] and per_rank[named]["phase"] == "rollout"
    assert line < per_rank[named]["peak_mib"] < line + 64, per_rank[named]
    assert per_rank[named]["line_mib"] == pytest.approx(line) and failing["plan_ratio"] is None  # (stopped there)
    # undone on every rank, neither kept the rollout or moved on: each undid it (the others crossed too, or reached
    # their next decision), or, where one waited inside the gather's collectives, every rank was restarted
    undone, restarted = facts["undone"], "every rank was restarted" in stopped
    assert undone["gathered_on_every_rank"] == ([0, 0] if restarted else [1, 1]), (undone, stopped)
    assert undone["layout_restored"] == [True, True]
    assert undone["steps"] == [0, 0] and undone["next_phase"] == "rollout"
    # layer by layer: the whole step ran, every rank under the same line in every phase
    assert fixed["stopped"] is None and not fixed["crossed"] and fixed["line_mib"] == failing["line_mib"]
    for device, rank in facts["fixed_per_rank"].items():
        assert not rank["over"] and rank["peak_mib"] < rank["line_mib"] == pytest.approx(line), (device, rank)
    assert set(fixed["phase_peaks_mib"]) == {
        "rollout",
        "rewards",
        "advantages",
        "logprobs",
        "backward",
        "optimizer",
        "sync",
    }
    assert 0.9 <= fixed["plan_ratio"] <= 1.1, fixed  # the plan within 10 % of the fix's measured peak (rank 0)
    # the gather is what crossed: each rank's gathered rollout stood above its layer-by-layer whole step
    for device in per_rank:
        assert per_rank[device]["peak_mib"] > facts["fixed_per_rank"][device]["peak_mib"]
    check_prose(NAME, nb, facts)  # no number in its prose that a cell does not compute
    check_static_figures(nb)


@pytest.mark.slow
def test_06_explains_the_driver_s_rss_and_keeps_its_other_sections(story):
    nb, facts = story
    text = printed(nb)
    assert "RankExecutor ['rank0/cpu', 'rank1/cpu']" in text
    assert "rank0/host" in text and "rank1/host" in text  # every rank's rows in the memory table
    # the driver's host row is its process tree: the ranks and Ray's own processes are in it
    tree, own = facts["driver_mib"]["tree"], facts["driver_mib"]["process"]
    assert tree["ranks"] > 0 and tree["Ray's own processes"] > 0 and tree["driver (this process)"] > 0
    parts = [v for k, v in tree.items() if k != "all"]
    # each value is rounded to 0.01 MiB, so the parts' sum may differ from the rounded total by 0.005 per term
    assert tree["all"] == pytest.approx(sum(parts), abs=0.005 * (len(parts) + 1))
    assert tree["ranks"] + tree["Ray's own processes"] > tree["driver (this process)"]
    assert sum(own.values()) == pytest.approx(tree["driver (this process)"], rel=0.05)
    # P3's cleanup: a generation that raised (gathered, then layer by layer) left every rank's layout as it was
    assert text.count("rollout failed on every rank: RuntimeError: injected failure in rollout") == 2
    assert facts["layout_restored_after_failed_rollout"] is True
    # P5: the naive reference fails inside torch; the check refuses it in one line; the prepared copy scores as the base
    assert "meta" in facts["p5_device_error"]
    assert facts["p5_refused"].startswith("reference: model.embed_tokens.weight is on meta, the policy computes on cpu")
    assert "\n" not in facts["p5_refused"]
    assert facts["reference_copy_vs_adapter_disabled_max_abs_diff"] <= 1e-5
    # the OOM on rank 1: one line naming the rank, every rank's LoRA and AdamW shards bit for bit, the step runs again
    assert facts["oom_line"].startswith("backward failed on rank 1: out of memory") and "\n" not in facts["oom_line"]
    assert facts["oom_lora_bit_identical"] == [True, True] and facts["oom_optimizer_bit_identical"] == [True, True]
    assert all(lora > 0 and adam > 0 for lora, adam in facts["oom_tensors_compared"])
    assert facts["step_after_oom"] == 1
    # a rank SIGKILLed inside backward: one line naming it (not an OOM), and the step runs again
    assert facts["kill_line"].startswith("backward failed on rank 1: its process died"), facts["kill_line"]
    assert "memory" not in facts["kill_line"] and facts["kill_retry_step"] == facts["step_after_oom"] + 1


@pytest.mark.slow
def test_06_rays_memory_monitor_kills_a_rank_and_the_ranks_held_under_its_line_run_the_fix(story):
    """P4 for real: Ray's own monitor (RAY_memory_usage_threshold, set low and said so) kills a rank as the machine's
    used RAM passes its line; the plan against that line and the ranks' budgets within it run the fix to its end, a
    step with a gradient; the figure shows both runs against the line."""
    nb, facts = story
    line = facts["ray_line_gib"]
    killed = facts["ray_killed"]
    assert killed and "\n" not in killed and " failed on rank " in killed, killed
    assert "killed by Ray's memory monitor (the node's memory crossed its kill threshold)" in killed
    assert "every rank was restarted" in killed  # the kernel's Lab went on, the step not applied
    assert facts["ray_killed_machine_peak_gib"] > line
    refused = facts["ray_budget_refused"]
    assert refused.startswith("placement.rank_memory_gib: 2 CPU ranks x ") and "pass Ray's kill line" in refused
    offered = float(refused.rsplit("give each rank at most ", 1)[1].removesuffix(" GiB"))
    # (what the machine uses is read again as the refusal is made: the room it offers moves with it by a few MiB)
    assert offered == pytest.approx(facts["ray_rank_budget_gib"], abs=0.05), (offered, refused)
    planned = facts["ray_planned"]
    assert not any(r["fits"] for r in planned["full"].values()) and all(r["fits"] for r in planned["chunked"].values())
    budget_mib = facts["ray_rank_budget_gib"] * 1024
    assert all(r["capacity_mib"] == pytest.approx(budget_mib) for r in planned["full"].values())
    fixed = facts["ray_fixed"]
    assert fixed["step"] == 0 and fixed["machine_peak_gib"] < line  # the same step, now applied, under Ray's line
    assert set(fixed["ranks"]) == {"rank0/host", "rank1/host"}
    for device, rank in fixed["ranks"].items():
        # (the facts are printed at 2 decimals: the line within 0.01 MiB of the budget's 95 %)
        assert not rank["over"] and rank["line_mib"] == pytest.approx(budget_mib * 0.95, abs=0.01), (device, rank)
    # the fixed step learns something: its group's rewards differ, so the loss has a gradient the update applies
    assert fixed["reward_std"] > 0 and fixed["grad_norm"] > 0, fixed
    for device, ratio in facts["ray_plan_ratios"].items():
        assert 0.9 <= ratio <= 1.1, (device, ratio)  # the plan within 10 % of each rank's measured peak
    figures = [o["data"] for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert any("against Ray's kill line" in f.get("text/plain", "") for f in figures)  # the section's figure, saved
    text = printed(nb)
    assert "RAY_memory_usage_threshold=" in text and "under Ray's line" in text
