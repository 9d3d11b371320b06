"""The CLI as a user runs it: the README's main command, metrics on disk, and bad input -> exit 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_lab import cli

ROOT = Path(__file__).resolve().parents[1]


def grpo_lab(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "grpo_lab", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )


def test_readme_run_command_finishes_and_writes_the_run(tmp_path):
    """`scripts/demo.sh` is the README's main command: install, build the tiny model, run."""
    out = tmp_path / "run"
    proc = subprocess.run(
        ["bash", "scripts/demo.sh", "--steps", "3", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"run directory: {out}" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        for key in ("reward_mean", "loss", "kl", "grad_norm", "seconds/rollout", "seconds/backward", "seconds/sync"):
            assert key in row, key
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["run"]["steps"] == 3 and resolved["run"]["output_dir"] == str(out)
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert "step 2:" in proc.stderr  # one summary line per step
    # readable output: the per-phase memory table once, at the end; then the run directory and the report
    assert proc.stderr.count("peak of 3 steps, MiB") == 1 and proc.stderr.count("rollout ") == 1
    assert proc.stderr.rindex("peak of 3 steps") > proc.stderr.rindex("step 2:")
    assert f"report: open {out / 'report.html'}" in proc.stdout and (out / "report.html").is_file()
    for noise in ("Traceback", "Failed to load CPU gemm_4bit_forward", "Loading weights"):
        assert noise not in proc.stderr, noise


def test_verbose_prints_the_memory_table_after_every_step(tiny_model, tmp_path, capsys):
    from grpo_lab.cli import main

    assert main(["run", "tiny-cpu", "--steps", "2", "--out", str(tmp_path / "run"), "--verbose"]) == 0
    err = capsys.readouterr().err
    assert err.count("memory MiB") == 2 and err.count("peak of 2 steps, MiB") == 1


def test_run_with_overrides_and_existing_dir_is_refused(tiny_model, tmp_path, capsys):
    """In-process (cli.main): a fresh process adds nothing here; the README's command runs as a subprocess above."""
    out = tmp_path / "run"
    run = ["run", "tiny-cpu", "--steps", "1", "--out", str(out), "--quiet", "--set", f"model.name_or_path={tiny_model}"]
    assert cli.main([*run, "--set", "grpo.loss_type=grpo"]) == 0, capsys.readouterr().err[-2000:]
    assert yaml.safe_load((out / "config.yaml").read_text())["grpo"]["loss_type"] == "grpo"
    capsys.readouterr()
    assert cli.main(run) == 2
    err = capsys.readouterr().err
    assert "holds a finished run" in err and "--resume DIR" in err, err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1  # untouched


@pytest.mark.parametrize(
    "override, expected",
    [
        ("grpo.bogus=1", "grpo.bogus"),
        ("generator.chunk_size=0", "generator.chunk_size"),
        ("generator.chunk_size=-2", "generator.chunk_size"),
        ("grpo.beta=-0.5", "grpo.beta"),
        ("grpo.num_generations=1", "grpo.num_generations"),
        ("model.name_or_path=./no/such/model", "model.name_or_path"),
        ("placement.learner=cuda:99", "placement.learner"),
        ("reference.strategy=none", "reference.strategy"),  # tiny-cpu has beta 0.04
        ("data.dataset=missing.jsonl", "data.dataset"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_no_run_dir(tmp_path, tiny_model, override, expected):
    out = tmp_path / "run"
    sets = [] if override.startswith("model.") else ["--set", f"model.name_or_path={tiny_model}"]
    proc = grpo_lab("run", "tiny-cpu", "--out", str(out), *sets, "--set", override)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2
    assert len(lines) == 1 and lines[0].startswith("grpo-lab: error:") and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_missing_config_file_and_bad_steps(tmp_path, capsys):
    """In-process (cli.main); a bad value's exit 2 from a real process is the test above."""
    assert cli.main(["run", str(tmp_path / "nope.yaml")]) == 2
    assert "is neither a YAML file nor a preset" in capsys.readouterr().err
    assert cli.main(["run", "tiny-cpu", "--steps", "0"]) == 2 and "--steps" in capsys.readouterr().err


def test_tiny_command_is_deterministic(tmp_path):
    """`grpo-lab tiny` twice writes the same bytes; a present model is left alone, --force rebuilds it. The CLI's
    part runs on tiny-random (the trained default spends ~3 min per build on one thread, three builds made this the
    suite's slowest test); the training's determinism is checked below on a 4-step trained build of the same shape."""
    for name in ("a", "b"):
        assert grpo_lab("tiny", str(tmp_path / name), "--model", "tiny-random").returncode == 0
    for file in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file
    (tmp_path / "a" / "model.safetensors").write_bytes(b"damaged")
    # in-process from here (cli.main): the two builds above are the ones that need processes of their own
    assert cli.main(["tiny", str(tmp_path / "a"), "--model", "tiny-random"]) == 0  # present: left as it is
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == b"damaged"
    assert cli.main(["tiny", str(tmp_path / "a"), "--model", "tiny-random", "--force"]) == 0  # rebuilt
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-tools"])
def test_a_trained_build_is_deterministic(tmp_path, model):
    """A built-in trained model's recipe (models.tiny.BUILTINS), cut to 4 training steps, twice: the same bytes."""
    from grpo_lab.models.tiny import BUILTINS, build_tiny_model

    recipe = {**BUILTINS[model][1], "train_steps": 4}
    for name in ("a", "b"):
        build_tiny_model(tmp_path / name, **recipe)
    for file in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file


def test_building_a_built_in_model_shows_its_progress(tmp_path, capsys):
    """Issue 34: the first load ran minutes showing nothing while the built-in model trained. The build shows a
    progress bar (tqdm: a widget in a notebook, stderr here) naming what it does, with the time left."""
    from grpo_lab.cli import main

    assert main(["tiny", str(tmp_path / "m"), "--model", "tiny-random"]) == 0
    err = capsys.readouterr().err
    assert "building m (once; later loads read it)" in err and "100%" in err and "saving" in err
    from grpo_lab.models.tiny import build_tiny_model

    build_tiny_model(tmp_path / "t", train_steps=3, label="a trained one")  # a trained build counts its steps
    err = capsys.readouterr().err
    assert "a trained one" in err and "training on the arithmetic set (3 steps)" in err and "6/6" in err
