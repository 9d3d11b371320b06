"""ui/story, what the guided notebooks share: the parameters cell checked in one line, facts printed as JSON, the
per-phase peak table, trial() (one step measured against the host guard's line) and show() (a plotly figure with
its PNG in one output)."""

from __future__ import annotations

import io
import json

import nbformat
import numpy as np
import plotly.graph_objects as go
import pytest
import torch
from PIL import Image

from grpo_lab import Lab
from grpo_lab.errors import LabError
from grpo_lab.memory.readers import MiB
from grpo_lab.memory.sampler import HostMemoryExceeded
from grpo_lab.ui import story
from grpo_lab.ui.story import Story, check_parameters, peak_table, show, trial

pytestmark = pytest.mark.xdist_group("story")  # why: its trial tests share module-scoped Labs

TINY = ["model.name_or_path=builtin:tiny-random"]


def test_an_unknown_preset_is_one_line_naming_the_parameter():
    with pytest.raises(LabError) as caught:
        check_parameters("no-such-preset")
    line = str(caught.value)
    assert line.startswith("parameter config: config 'no-such-preset' is neither a YAML file nor a preset")
    assert "\n" not in line
    with pytest.raises(LabError, match=r"^parameter preset: grpo\.nope: unknown key"):
        check_parameters("tiny-cpu", ["grpo.nope=1"], field="preset")


def test_a_cuda_placement_without_a_cuda_device_is_refused_and_accepted_with_one(monkeypatch):
    import grpo_lab.checks.devices as devices

    cuda = ["placement.learner=cuda:0"]
    if not torch.cuda.is_available():  # this machine as it is
        with pytest.raises(LabError, match=r"^parameter config: .*cuda:0.*no CUDA device"):
            check_parameters("tiny-cpu", cuda)
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 0)
    with pytest.raises(LabError) as caught:
        check_parameters("tiny-cpu", cuda)
    line = str(caught.value)
    assert line.startswith("parameter config: 'tiny-cpu' places work on cuda:0") and "no CUDA device" in line
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 1)
    assert check_parameters("tiny-cpu", cuda).placement.learner == "cuda:0"
    assert check_parameters("tiny-cpu").placement.learner == "cpu"


def test_a_cpu_only_budget_is_applied_to_a_cpu_config_and_not_to_a_gpu_one(monkeypatch):
    """The stories' host budget binds a CPU learner; on a GPU config the card is the budget (emulate_card), so the
    host guard must not hold the process's RSS (CUDA's own host memory) to a CPU-sized budget."""
    import grpo_lab.checks.devices as devices

    budget = ["placement.host_memory_gib=3"]
    cpu = Story("tiny-cpu", TINY, on_cpu=budget)
    assert cpu.config.placement.host_memory_gib == 3
    cpu.emulate_card(24)  # a no-op on the CPU
    assert "gpu" not in cpu.facts
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 1)
    gpu = Story("tiny-cpu", [*TINY, "placement.learner=cuda:0"], on_cpu=budget)
    assert gpu.on_gpu and gpu.config.placement.host_memory_gib is None


def test_story_facts_are_returned_and_shown_as_one_json_output_at_the_end(monkeypatch):
    """The facts are one output: JSON (what the tests read, facts_in), and a text form naming them, not a printed
    dict a reader has to scroll past."""
    from grpo_lab.ui.story import FACTS_MIME, facts_in

    shown = []
    monkeypatch.setattr("IPython.display.display", lambda bundle, raw=False: shown.append((bundle, raw)))
    s = Story("tiny-cpu", TINY)
    assert s.config.model.name_or_path == "builtin:tiny-random" and not s.on_gpu
    assert s.fact("peak_mib", 612.5) == 612.5
    s.fact("steps", 3)
    s.fact("loss", torch.tensor(0.25))  # a tensor is written as its float
    s.fact("line", {"mib": 1.4 * 1024 * 0.95, "diff": [3.2e-7 + 1e-20]})  # as printed: 1361.92, 3.2e-07
    s.end()
    ((bundle, raw),) = shown
    facts = {"peak_mib": 612.5, "steps": 3, "loss": 0.25, "line": {"mib": 1361.92, "diff": [3.2e-7]}}
    assert raw and bundle[FACTS_MIME] == facts and json.dumps(bundle[FACTS_MIME])
    assert bundle["text/plain"] == "facts: peak_mib, steps, loss, line (recorded for the story's test)"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("story.end()")])
    nb.cells[0].outputs = [nbformat.v4.new_output("display_data", {k: v for k, v in bundle.items()})]
    assert facts_in(nbformat.reads(nbformat.writes(nb), as_version=4)) == facts  # as a saved notebook holds it


def test_gpu_cells_are_skipped_with_a_line_on_a_cpu_config(capsys, monkeypatch):
    assert Story("tiny-cpu", TINY).gpu_cells() is False
    assert capsys.readouterr().out.startswith("GPU cells skipped: this config runs on the CPU")
    monkeypatch.setattr("grpo_lab.checks.devices.cuda_device_count", lambda: 1)
    assert Story("qwen2.5-7b-nf4-24gb").gpu_cells() is True
    assert capsys.readouterr().out == ""


def row(step, phase, device, metric, peak_mib, failed_attempt=None):
    return dict(
        step=step, phase=phase, device=device, metric=metric, peak=peak_mib * MiB, failed_attempt=failed_attempt
    )


def test_peak_table_shows_each_devices_peak_in_mib_and_marks_rolled_back_rows():
    """The Lab's own figures: notebook 01's table headed the machine's used RAM (3,052 MiB, whatever ran beside it)
    "host peak" beside the Lab's own 634."""
    rows = [
        row(0, "rollout", "host", "rss", 1536.4),  # the Lab's processes
        row(0, "rollout", "host", "used", 9999),  # unbudgeted: the machine's, not the table's
        row(0, "rollout", "cuda:0", "allocated", 300),
        row(0, "rollout", "cuda:0", "reserved", 8888),  # not the GPU's table metric
        row(0, "backward", "host", "rss", 2048, failed_attempt=0),  # the step's first attempt, rolled back
        row(0, "backward", "host", "rss", 1800.6),  # its redo
        row(1, "rollout", "host", "rss", 700),
    ]
    html = peak_table(rows)
    assert html.startswith("<table><tr><th>step</th><th>phase</th><th>host rss peak (MiB)</th><th>cuda:0 allocated")
    assert "<tr><td>0</td><td>rollout</td><td>1,536</td><td>300</td></tr>" in html
    assert "<tr><td>0</td><td>backward (rolled back)</td><td>2,048</td><td></td></tr>" in html
    assert "<tr><td>0</td><td>backward</td><td>1,801</td><td></td></tr>" in html
    assert "<tr><td>1</td><td>rollout</td><td>700</td><td></td></tr>" in html
    assert "9,999" not in html and "8,888" not in html
    only = peak_table(rows, phases=["backward"])
    assert "rollout" not in only and only.count("<tr>") == 3  # the header and backward's two attempts
    assert "cuda:0" not in only


def test_show_puts_one_form_of_a_figure_in_its_output_the_live_one_or_the_png(monkeypatch):
    """A person's frontend gets plotly's live figure, a headless run (papermill) the PNG: never both, so a saved
    notebook holds each figure once."""
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, **kw: shown.append((obj, kw)))
    fig = go.Figure([go.Scatter(x=[0, 1], y=[1, 2], name="a"), go.Bar(x=["p", "q"], y=[2, 1], name="b")])
    fig.update_layout(title="two traces")
    for live in ("1", "0"):
        monkeypatch.setenv("GRPO_LAB_LIVE_WIDGETS", live)
        show(fig, width=500)
    (live, kw), (headless, _) = shown
    assert kw == {"raw": True}
    assert live.keys() == {"application/vnd.plotly.v1+json", "text/plain"} and live["text/plain"] == "two traces"
    assert live["application/vnd.plotly.v1+json"]["data"][1]["type"] == "bar"
    assert headless.keys() == {"image/png", "text/plain"} and headless["image/png"].startswith(b"\x89PNG")
    assert Image.open(io.BytesIO(headless["image/png"])).size[0] == 500


@pytest.fixture(scope="module")
def free_lab(tiny_model):
    """tiny-cpu on the random tiny model, no host budget (the machine's RAM)."""
    lab = Lab("tiny-cpu", overrides=[*TINY, "generator.max_completion_length=16"]).load()
    yield lab
    lab.close()


@pytest.fixture(scope="module")
def budget_lab(tiny_model):
    """The same, held to 0.3 GiB (below this process's RSS)."""
    lab = Lab("tiny-cpu", overrides=[*TINY, "generator.max_completion_length=16", "placement.host_memory_gib=0.3"])
    lab = lab.load()
    yield lab
    lab.close()


def test_a_trial_whose_run_raises_a_lab_error_reports_its_line(free_lab, capsys):
    line = "backward: made up for the test; do something else"

    def run():
        raise LabError(line)

    out = trial(free_lab, "refused", run=run)
    assert out["stopped"] == line and out["label"] == "refused" and out["crossed"] is False
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("refused: peak ") and printed[-1].endswith(f"-> {line}")

    def oom():  # a card's cap: the allocation that would pass it fails, so no reading is over the line
        raise LabError("out of memory in phase 'backward' of step 0 on cuda:0: CUDA out of memory; ...")

    assert trial(free_lab, "capped", run=oom)["crossed"] is True


def test_a_step_under_the_machines_ram_is_a_trial_that_does_not_cross(free_lab, capsys):
    first = len(free_lab.memory.phase_rows)
    out = trial(free_lab, "no budget")
    assert out["stopped"] is None and out["crossed"] is False
    used = [r for r in free_lab.memory.phase_rows[first:] if r["device"] == "host" and r["metric"] == "used"]
    top = max(used, key=lambda r: r["peak"])  # the guard's figure (the machine's used RAM, with no budget)
    assert out["peak_mib"] == top["peak"] / MiB > 100 and out["phase"] == top["phase"]
    limit = free_lab.memory.latest("host")["limit"]
    assert out["line_mib"] == pytest.approx(limit * free_lab.config.memory.host_threshold / MiB)
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("line -> the step ran")


def test_a_trial_prints_the_plan_beside_the_labs_own_peak_of_the_phase(free_lab, capsys):
    """Every story's measured peak with its plan beside it: the plan of the phase that peaked, over the Lab's own
    figure of that phase (its RSS: unbudgeted, the guard's `used` is the machine's, whatever runs beside it)."""
    from grpo_lab.planner import plan

    first = len(free_lab.memory.phase_rows)
    out = trial(free_lab, "a rollout", run=free_lab.rollout)
    assert out["phase"] == "rollout"
    own = max(r["peak"] for r in free_lab.memory.phase_rows[first:] if r["device"] == "host" and r["metric"] == "rss")
    planned = plan(free_lab.config).devices["host"].phase_peak("rollout")
    # (no bound on the ratio: in a long-lived pytest worker the process holds what earlier tests left)
    assert out["plan_ratio"] == round(planned / own, 3) > 0, out
    assert f"plan / measured {out['plan_ratio']:.2f})" in capsys.readouterr().out
    free_lab.step()  # the rest of the step, for the tests after this one


def test_a_step_over_a_tiny_budget_is_a_trial_that_crosses_and_stops(budget_lab):
    """The guard stops before the first phase, so no phase row exists: its reading is the trial's peak (this read 0
    MiB 'under' the line before the fix)."""
    out = trial(budget_lab, "0.3 GiB")
    assert out["stopped"] and "placement.host_memory_gib" in out["stopped"]
    assert "stopped before phase 'rollout'" in out["stopped"]
    assert out["line_mib"] == pytest.approx(0.3 * 1024 * 0.95)
    assert out["crossed"] is True and out["phase"] == "the guard's reading"


def test_a_phase_whose_rss_rises_over_the_budgets_line_is_a_crossed_trial(budget_lab, capsys):
    """The budget put just above the Lab's RSS (on its reader: placement.host_memory_gib is fixed at load), then a
    phase that holds 400 MiB more: its peak is over the line, and the guard fails that phase as it ends (issue 51: no
    later phase needs to be there), quoting the figure the trial reads."""
    memory = budget_lab.memory
    reader = memory.readers[0]
    reader.budget = reader.read()["rss"] + 200 * MiB
    try:  # clears the guard's record of the readings against 0.3 GiB (it raises if they crossed, as they did)
        memory.check_host(budget_lab.step_index, "rewards")
    except HostMemoryExceeded:
        pass

    def phase_holding_400_mib():
        with budget_lab.timeline.phase("rewards", budget_lab.step_index):
            held = np.ones(400 * MiB // 8)
            memory.read()
            del held

    out = trial(budget_lab, "a phase over the line", run=phase_holding_400_mib)
    assert "during phase 'rewards'" in out["stopped"] and out["phase"] == "rewards"
    quoted = float(out["stopped"].split("reached ")[1].split("%")[0]) / 100  # the guard's used / limit
    assert quoted * reader.budget / MiB == pytest.approx(out["peak_mib"], rel=1e-3)  # one figure, the row's
    assert out["line_mib"] == pytest.approx(reader.budget * 0.95 / MiB)
    assert out["peak_mib"] > out["line_mib"] and out["crossed"] is True
    # a phase the guard stopped peaked where it was stopped: no plan / measured beside it (the plan's is no peak of it)
    assert out["plan_ratio"] is None and "plan / measured" not in capsys.readouterr().out.replace("no plan /", "")


def test_snapshot_shows_the_timeline_and_the_peak_table(free_lab, monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, **kw: shown.append(obj))
    monkeypatch.setenv("GRPO_LAB_LIVE_WIDGETS", "0")  # headless, as papermill runs a story: the PNG
    if not free_lab.memory.phase_rows:
        free_lab.step()
    story.snapshot(free_lab, ["backward"])
    bundle, table = shown
    assert bundle["image/png"].startswith(b"\x89PNG") and "application/vnd.plotly.v1+json" not in bundle
    assert isinstance(table, IPython.display.HTML) and "<td>backward</td>" in table.data
    assert "<td>rollout" not in table.data


def test_a_gpus_line_is_its_capacity_times_the_share_this_process_may_use(monkeypatch):
    """Story.emulate_card caps the card with torch.cuda.set_per_process_memory_fraction: the trials' line must be the
    capped card, or an OOM at the cap would read as under the line."""
    import grpo_lab.ui.story as story

    class Memory:
        host_threshold = 0.95

    class FakeLab:
        memory = Memory()

    monkeypatch.setattr("grpo_lab.memory.report.capacities_of", lambda memory: {"cuda:0": 80 * 2**30})
    monkeypatch.setattr(story, "card_share", lambda device: 0.3)
    assert story.budget_line(FakeLab(), "cuda:0") == pytest.approx(0.3 * 80 * 1024)
    monkeypatch.setattr(story, "card_share", lambda device: 1.0)
    assert story.budget_line(FakeLab(), "cuda:0") == pytest.approx(80 * 1024)


def test_each_ranks_peak_is_read_against_its_own_line_from_the_row_asked_for():
    """rank_peaks reads what trial reads (device_peak): each budgeted rank's host `used` peak from row `since` on,
    undone attempts included, against its budget x memory.host_threshold; rows before `since`, GPU series and an
    unbudgeted device are left out."""
    import grpo_lab.ui.story as story

    MiB = 2**20

    def row(device, phase, peak, metric="used", failed=None):
        return dict(device=device, phase=phase, peak=peak * MiB, metric=metric, failed_attempt=failed, step=0)

    class Memory:
        host_threshold = 0.5
        rank_capacities = {"rank0/host": 1000 * MiB, "rank1/host": 2000 * MiB}
        readers = []
        phase_rows = [
            row("rank0/host", "rollout", 5000),  # before `since`: not this trial's
            row("rank0/host", "rollout", 400),
            row("rank0/host", "backward", 600, failed=0),  # the undone attempt is the crossing
            row("rank1/host", "rollout", 900),
            row("rank1/cuda:0", "rollout", 9000, metric="allocated"),
            row("rank2/host", "rollout", 10),  # no budget measured: no line to read it against
        ]

        def latest(self, device):
            return {}

    class FakeLab:
        memory = Memory()

    peaks = story.rank_peaks(FakeLab(), since=1)
    assert peaks == {
        "rank0/host": dict(peak_mib=600, phase="backward", line_mib=500, over=True),
        "rank1/host": dict(peak_mib=900, phase="rollout", line_mib=1000, over=False),
    }
    table = story.format_rank_peaks(peaks).splitlines()
    assert len(table) == 3 and "over its line" in table[1] and "under its line" in table[2]
