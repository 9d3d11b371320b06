"""report.html read as a user reads it, in headless Chromium (screenshots kept in .artifacts/report/): the
summary names the peak's device, phase and step; the phase bands are labelled; a far-off limit does not
stretch the memory axis; the per-phase table is a real table. Plus the pure parts, on recorded rows."""

from __future__ import annotations

import json

import pytest
from html_pages import needs_chromium, opened

from grpo_lab.cli import main
from grpo_lab.memory.figures import timeline_figure
from grpo_lab.memory.readers import MiB
from grpo_lab.memory.report import device_summary


def test_summary_names_each_devices_peak_phase_step_and_headroom():
    rows = [
        {"step": s, "phase": p, "device": d, "metric": m, "start": 0, "peak": v * MiB}
        for s, p, d, m, v in [
            (0, "rollout", "host", "rss", 500),
            (1, "backward", "host", "rss", 700),
            (1, "backward", "host", "used", 9000),
            (0, "rollout", "cuda:0", "reserved", 30_000),
            (0, "rollout", "cuda:0", "device_used", 41_000),
            (1, "backward", "cuda:0", "device_used", 38_000),
        ]
    ]
    summary = {d["device"]: d for d in device_summary(rows, {"host": 24_000 * MiB, "cuda:0": 40_960 * MiB})}
    assert (summary["host"]["phase"], summary["host"]["step"], summary["host"]["peak"]) == ("backward", 1, 700 * MiB)
    assert summary["host"]["metric"] == "rss" and summary["host"]["headroom"] == 23_300 * MiB
    gpu = summary["cuda:0"]  # NVML's device-wide used: what runs out (a vLLM engine beside the learner counts)
    assert (gpu["metric"], gpu["phase"], gpu["step"], gpu["headroom"]) == ("device_used", "rollout", 0, -40 * MiB)


def test_a_far_limit_is_named_not_drawn_and_a_near_one_is_drawn():
    samples = [(t, 0, "rollout", "host", "rss", (500 + t) * MiB) for t in range(10)]
    marks = [(0, "rollout", 0.0, 6.0), (0, "backward", 6.0, 9.0)]
    fig = timeline_figure(samples, marks, {"host limit": 24_000.0, "host threshold 95%": 520.0})
    assert fig.layout.yaxis.range[1] < 600  # not stretched to 24 GB
    texts = [a.text for a in fig.layout.annotations]
    assert any("off the scale: host limit: 23.44 GiB" in t for t in texts)  # as the plan writes a size
    assert [s.y0 for s in fig.layout.shapes if s.type == "line" and s.y0 == s.y1] == [520.0]
    assert {"rollout", "backward", "step 0"} <= set(texts)


@pytest.mark.slow
@needs_chromium
def test_report_in_a_real_browser(tiny_model, tmp_path):
    out = tmp_path / "run"
    assert main(["run", "tiny-cpu", "--steps", "2", "--out", str(out), "--set", "memory.sample_hz=50"]) == 0
    rows = [r for line in (out / "metrics.jsonl").read_text().splitlines() for r in json.loads(line)["memory"]]
    top = max((r for r in rows if r["device"] == "host" and r["metric"] == "rss"), key=lambda r: r["peak"])
    with opened(out / "report.html", "report/report.png") as page:
        summary = page.locator("ul.summary li.peak").first.inner_text()
        assert summary.startswith("host: peak") and f"in phase {top['phase']} of step {top['step']}" in summary
        assert "headroom" in summary and "Leak detector" in page.locator("ul.summary").inner_text()
        labels = (
            page.locator(".js-plotly-plot")
            .first.locator(".annotation-text")
            .evaluate_all("texts => texts.map(t => t.textContent)")
        )  # SVG text: no innerText
        assert "rollout" in labels and "step 0" in labels and "step 1" in labels
        y_top = page.evaluate("document.querySelectorAll('.js-plotly-plot')[0].layout.yaxis.range[1]")
        # the 24 GB limit is named, not drawn
        assert y_top < 2 * max(r["peak"] for r in rows if r["device"] == "host") / MiB
        assert any("off the scale" in t for t in labels)
        assert page.locator("table.phases tr").count() == 1 + sum(1 for r in rows if r["step"] == 1)
        assert page.locator(".js-plotly-plot").count() == 3  # timeline, host heatmap, reward/loss


RECORDED_GPU = [(1000, 2000, 9000), (5000, 6000, 13000), (3000, 6000, 13000)]  # MiB: allocated, reserved, NVML used


def recorded_gpu_report(path):
    """A report from a recorded CUDA sample stream (the CUDA path cannot run in CI): a sampler whose GPU probe
    replays CudaReader readings through the same ledger arithmetic, over one rollout and one backward."""
    from types import SimpleNamespace

    from grpo_lab.memory import MemorySampler
    from grpo_lab.memory.readers import gpu_ledger
    from grpo_lab.memory.report import write_report

    class RecordedCuda:
        device, total, i = "cuda:0", 80_000 * MiB, 0

        def read(self):
            allocated, reserved, used = (v * MiB for v in RECORDED_GPU[min(self.i, len(RECORDED_GPU) - 1)])
            self.i += 1
            return {**gpu_ledger(allocated, reserved, used), "peak": allocated}

    sampler = MemorySampler(["cpu"], hz=0, host_threshold=0.99)
    sampler.readers.append(RecordedCuda())
    for phase in ("rollout", "backward"):
        sampler.phase_started(0, phase)
        sampler.read()
        sampler.phase_ended(SimpleNamespace(step=0, phase=phase), None)
    return sampler, write_report(path, sampler, [], title="recorded GPU")


def test_the_gpu_ledger_is_stacked_so_its_top_is_nvml_used_and_the_summary_says_where_the_peak_went(tmp_path):
    from grpo_lab.memory.report import capacities_of, device_summary

    sampler, _ = recorded_gpu_report(tmp_path / "report.html")
    fig = timeline_figure(list(sampler.samples), sampler.marks)
    stacks = [t for t in fig.data if getattr(t, "stackgroup", None) == "cuda:0"]
    assert [t.name for t in stacks] == [
        "cuda:0 torch allocated",
        "cuda:0 torch cache (reserved - allocated)",
        "cuda:0 not torch (NVML used - the rest)",
    ]  # bottom-up
    tops = [sum(column) for column in zip(*(t.y for t in stacks))]
    used = [v / MiB for t, _, _, d, m, v in sampler.samples if (d, m) == ("cuda:0", "device_used")]
    assert tops == used and max(used) == 13000  # the stack's top is NVML's device-wide used
    assert [round(y) for y in stacks[2].y][-1] == 7000  # not torch: 13000 - 6000
    assert all(getattr(t, "stackgroup", None) is None for t in fig.data if t.name.startswith("host"))
    assert fig.layout.yaxis.range[1] >= 13000  # the axis holds the stack, not just one layer
    gpu = next(d for d in device_summary(sampler.phase_rows, capacities_of(sampler)) if d["device"] == "cuda:0")
    assert gpu["metric"] == "device_used" and gpu["peak"] == 13000 * MiB
    assert gpu["phase"] == "rollout"  # the first phase to reach 13000; each layer's own peak in it (not one instant)
    assert gpu["ledger"] == {"allocated": 5000 * MiB, "cached": 3000 * MiB, "not_torch": 7000 * MiB}


@needs_chromium
def test_the_gpu_ledger_in_a_real_browser(tmp_path):
    _, path = recorded_gpu_report(tmp_path / "report.html")
    with opened(path, "report/gpu-ledger.png", height=900) as page:
        gpu = page.locator("ul.summary li.peak", has_text="cuda:0").inner_text()
        assert "peak 13,000 MiB (device_used)" in gpu and "in phase rollout of step 0" in gpu
        assert "not torch (NVML used - the rest) 7,000" in gpu and "torch cache (reserved - allocated) 3,000" in gpu
        legend = (
            page.locator(".js-plotly-plot")
            .first.locator(".legendtext")
            .evaluate_all("texts => texts.map(t => t.textContent)")
        )
        assert "cuda:0 not torch (NVML used - the rest)" in legend
        filled = page.evaluate(
            "document.querySelectorAll('.js-plotly-plot')[0].data.filter(t => t.stackgroup === 'cuda:0').length"
        )
        assert filled == 3
        table = page.locator("table.phases tr").evaluate_all("rows => rows.map(r => r.innerText.split('\\t'))")
        not_torch = {r[0]: r[4] for r in table if r[1:3] == ["cuda:0", "not_torch"]}  # phase -> peak, MiB
        assert not_torch == {"rollout": "7,000.0", "backward": "7,000.0"}
        assert "which did not finish" in page.locator("h2", has_text="Per-phase memory").inner_text()


def test_the_live_plot_stacks_the_gpu_ledger_too(tmp_path):
    from grpo_lab.ui.live import LivePlot

    sampler, _ = recorded_gpu_report(tmp_path / "report.html")
    plot = LivePlot(sampler)
    plot.refresh()
    stacks = [t for t in plot.fig.data if getattr(t, "stackgroup", None) == "cuda:0"]
    assert [t.name.split(" ", 1)[1] for t in stacks] == [
        "torch allocated",
        "torch cache (reserved - allocated)",
        "not torch (NVML used - the rest)",
    ]
    assert [sum(c) for c in zip(*(t.y for t in stacks))][-1] == 13000 and stacks[2].y[-1] == 7000
    assert "cuda:0 capacity" in plot.fig.layout.title.text  # 80 GB is off the 13 GB scale: named, not drawn
    plot.stop()


def test_first_step_set_up_is_not_charged_to_the_advantages_phase(tiny_model, tmp_path):
    """A fresh process's step 0 charged ~90 MiB to advantages (TRL's utilities imported on first use), so
    report.html's heatmap and compare showed advantages as the heavy phase. That set-up is now done during load:
    step 0's advantages add almost nothing, and the heaviest phase is one that holds the step's tensors (the rollout,
    ~17 MiB, or backward, 19-22 MiB here: which of the two varies with the machine). A fresh interpreter, as a user's
    run."""
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_lab",
            "run",
            "tiny-cpu",
            "--set",
            f"model.name_or_path={tiny_model}",
            "--steps",
            "1",
            "--out",
            str(out),
            "--quiet",
        ],
        check=True,
        timeout=600,
    )
    rows = [
        r
        for line in open(out / "metrics.jsonl")
        for r in json.loads(line)["memory"]  # step 0's per-phase rows
        if r["device"] == "host" and r["metric"] == "rss"
    ]
    delta = {r["phase"]: float(r["delta"]) / 2**20 for r in rows}
    assert delta["advantages"] < 8, delta
    assert max(delta, key=delta.get) in ("rollout", "backward"), delta
