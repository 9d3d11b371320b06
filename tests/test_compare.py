"""`grpo-lab compare`: runs labelled by what differs in their configs, per-phase peaks per device (a failed
run's failing step included), reward/loss curves; the page read in headless Chromium (screenshot kept in
.artifacts/compare/); bad input is one line and exit 2, with nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from html_pages import needs_chromium, opened

from grpo_lab.cli import main
from grpo_lab.comparison import RunRecord, config_differences, label_runs, load_run, phase_peaks
from grpo_lab.memory.readers import MiB


def config(micro=4, out="a", beta=0.04):
    return {"grpo": {"micro_batch_size": micro, "beta": beta}, "run": {"output_dir": out, "seed": 0}}


def test_runs_are_labelled_by_the_fields_that_differ_output_dir_aside():
    runs = [
        RunRecord("a", config(4, "runs/a")),
        RunRecord("b", config(2, "runs/b")),
        RunRecord("c", config(2, "runs/c", 0.0)),
    ]
    assert config_differences(runs) == ["grpo.micro_batch_size", "grpo.beta"]
    assert [r.label for r in label_runs(runs)] == [
        "grpo.micro_batch_size=4, grpo.beta=0.04",
        "grpo.micro_batch_size=2, grpo.beta=0.04",
        "grpo.micro_batch_size=2, grpo.beta=0.0",
    ]


def test_runs_with_the_same_config_are_told_apart_by_their_directory_and_given_labels_are_kept():
    same = label_runs([RunRecord("a", config(out="x")), RunRecord("b", config(out="y"))])
    assert [r.label for r in same] == ["a", "b"]
    given = label_runs([RunRecord("p1", config(4), label="mb=4"), RunRecord("p2", config(2), label="mb=4")])
    assert [r.label for r in given] == ["mb=4 (p1)", "mb=4 (p2)"]


def test_phase_peaks_use_each_devices_primary_metric_and_leave_failed_attempts_out():
    rows = [
        {"step": 0, "phase": "backward", "device": "host", "metric": "rss", "start": 500 * MiB, "peak": 700 * MiB},
        {"step": 0, "phase": "backward", "device": "host", "metric": "used", "start": 0, "peak": 9000 * MiB},
        {"step": 1, "phase": "backward", "device": "host", "metric": "rss", "start": 600 * MiB, "peak": 650 * MiB},
        {
            "step": 1,
            "phase": "backward",
            "device": "host",
            "metric": "rss",
            "start": 0,
            "peak": 5000 * MiB,
            "failed_attempt": 1,
        },
        {"step": 0, "phase": "rollout", "device": "cuda:0", "metric": "reserved", "start": 0, "peak": 30_000 * MiB},
        {
            "step": 0,
            "phase": "rollout",
            "device": "cuda:0",
            "metric": "device_used",
            "start": 1000 * MiB,
            "peak": 41_000 * MiB,
        },
    ]
    failing = [
        {"step": 2, "phase": "optimizer", "device": "host", "metric": "rss", "start": 640 * MiB, "peak": 720 * MiB}
    ]
    run = RunRecord(
        "r",
        metrics=[{"step": 0, "memory": rows[:2] + rows[4:]}, {"step": 1, "memory": rows[2:4]}],
        failed_rows=failing,
        status="failed",
    )
    assert phase_peaks(run) == {
        ("host", "rss"): {"backward": 700 * MiB, "optimizer": 720 * MiB},
        ("cuda:0", "device_used"): {"rollout": 41_000 * MiB},
    }
    rise = phase_peaks(run, rise=True)
    assert rise[("host", "rss")] == {"backward": 200 * MiB, "optimizer": 80 * MiB}
    assert rise[("cuda:0", "device_used")] == {"rollout": 40_000 * MiB}


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpo-lab: error: ") and "\n" not in err
    return err


def test_bad_compare_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("grpo: {micro_batch_size: 2}\n")
    (tmp_path / "empty").mkdir()
    out = tmp_path / "page.html"
    assert "give at least two run directories" in _one_line_error(capsys, ["compare", str(run), "--out", str(out)])
    assert "no such directory" in _one_line_error(
        capsys, ["compare", str(run), str(tmp_path / "nope"), "--out", str(out)]
    )
    assert "no config.yaml or metrics.jsonl" in _one_line_error(
        capsys, ["compare", str(run), str(tmp_path / "empty"), "--out", str(out)]
    )
    assert "is a directory" in _one_line_error(capsys, ["compare", str(run), str(run), "--out", str(tmp_path)])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.yaml").write_text("grpo: [unclosed\n")
    assert "not valid YAML" in _one_line_error(capsys, ["compare", str(run), str(bad), "--out", str(out)])
    assert not out.exists() and not list(tmp_path.glob(".page.html*"))


@pytest.mark.slow
@needs_chromium
def test_compare_a_run_with_its_out_of_memory_twin_in_a_real_browser(tiny_model, tmp_path, monkeypatch, capsys):
    """The story the page is for: micro-batch 4 runs out of memory in step 1's backward, micro-batch 2 fits."""
    import grpo_lab.algo.grpo as step_module

    fits, fails = tmp_path / "mb2", tmp_path / "mb4"
    common = ["--steps", "2", "--quiet", "--set", "memory.sample_hz=50"]
    assert main(["run", "tiny-cpu", "--out", str(fits), "--set", "grpo.micro_batch_size=2", *common]) == 0
    real, calls = step_module.completion_logprobs, []

    def no_room_for_four(model, prompt_ids, *args):  # step 0's two backward micro-batches fit, step 1's do not
        if torch.is_grad_enabled() and prompt_ids.shape[0] > 2:
            calls.append(1)
            if len(calls) > 2:
                raise torch.OutOfMemoryError("CPU out of memory. Tried to allocate 2.00 GiB (fake)")
        return real(model, prompt_ids, *args)

    with monkeypatch.context() as m:
        m.setattr(step_module, "completion_logprobs", no_room_for_four)
        assert main(["run", "tiny-cpu", "--out", str(fails), *common]) == 2
    failed = load_run(fails)
    assert failed.status == "failed" and len(failed.metrics) == 1 and "out of memory" in failed.error.lower()
    assert failed.failed_rows and failed.failed_rows[-1]["phase"] == "backward"

    page_path = tmp_path / "compare.html"
    capsys.readouterr()
    assert main(["compare", str(fits), str(fails), "--out", str(page_path)]) == 0
    assert str(page_path) in capsys.readouterr().out
    with opened(page_path, "compare/compare.png") as page:
        rows = page.locator("table.runs tr").evaluate_all("rows => rows.map(r => r.innerText)")
        assert len(rows) == 3
        assert "grpo.micro_batch_size=2" in rows[1] and "finished" in rows[1]
        assert "grpo.micro_batch_size=4" in rows[2] and "failed in backward of step 1" in rows[2]
        assert "grpo.micro_batch_size" in page.locator("table.differences").inner_text()
        legend = (
            page.locator(".js-plotly-plot")
            .first.locator(".legendtext")
            .evaluate_all("texts => texts.map(t => t.textContent)")
        )
        assert legend == ["grpo.micro_batch_size=2", "grpo.micro_batch_size=4"]
        traces = page.evaluate("document.querySelectorAll('.js-plotly-plot')[0].data.map(t => [t.name, t.x, t.y])")
        peak_bars = {name: dict(zip(x, y)) for name, x, y in traces[:2]}  # host: absolute peaks, one trace per run
        fitted = [r for line in (fits / "metrics.jsonl").read_text().splitlines() for r in json.loads(line)["memory"]]
        assert peak_bars["grpo.micro_batch_size=2"]["backward"] == pytest.approx(
            max(r["peak"] for r in fitted if (r["phase"], r["device"], r["metric"]) == ("backward", "host", "rss"))
            / MiB
        )
        assert peak_bars["grpo.micro_batch_size=4"]["backward"] > 0  # the failing step's backward, from memory.csv
        curves = page.evaluate("document.querySelectorAll('.js-plotly-plot')[1].data.map(t => [t.name, t.x])")
        assert [len(x) for _, x in curves[::2]] == [2, 1]  # reward: two steps, and the one that finished


def test_identical_curves_stay_distinguishable_and_the_page_path_is_absolute(tmp_path, monkeypatch):
    """Two runs with identical reward curves drew one line over the other; `compare` printed a relative path."""
    from grpo_lab.comparison import RunRecord, compare, training_figure

    metrics = [{"step": i, "reward_mean": 0.1 * i, "loss": 0.5} for i in range(3)]
    runs = [RunRecord(name=f"run{k}", label=f"run{k}", metrics=metrics) for k in range(2)]
    traces = [t for t in training_figure(runs).data if t.xaxis == "x"]
    assert len({(t.line.dash, t.marker.symbol) for t in traces}) == 2
    monkeypatch.chdir(tmp_path)
    out = compare(runs, "compare.html")
    assert out.is_absolute() and out == tmp_path / "compare.html" and out.is_file()
