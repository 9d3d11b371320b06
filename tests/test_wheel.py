"""A user without the repo: the built wheel, installed into a new venv, runs a preset by name from an
empty directory, building its built-in model in the user cache (never in the working directory).

The new venv borrows the already-installed dependencies through a .pth line (installing torch,
vLLM, ... again would take minutes); grpo_lab itself comes only from the wheel, which the test
checks, so a file missing from the wheel (presets, planner shapes) fails here.
"""

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
RANDOM = "model.name_or_path=builtin:tiny-random"


def test_wheel_runs_a_preset_from_an_empty_directory(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    wheel = next(dist.glob("grpo_lab-*.whl"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (site / "zz_borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after grpo_lab's own dir

    work, cache = tmp_path / "empty", tmp_path / "cache"
    work.mkdir()
    env = {**os.environ, "GRPO_LAB_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false"}
    where = subprocess.run(
        [str(python), "-c", "import grpo_lab; print(grpo_lab.__file__)"],
        cwd=work,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert where.startswith(str(site)), where  # the wheel's copy, not the repo's

    grpo_lab = str(env_dir / "bin" / "grpo-lab")
    presets = subprocess.run([grpo_lab, "presets"], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert presets.returncode == 0 and "tiny-cpu" in presets.stdout and "tiny-demo" in presets.stdout, presets.stderr[
        -2000:
    ]
    proc = subprocess.run(
        # why the random built-in: the build in the user cache is what is checked; the trained one's minute of
        # training is the same package code, run by every other test that loads it
        [grpo_lab, "run", "tiny-cpu", "--steps", "3", "--out", str(tmp_path / "run"), "--set", RANDOM],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3
    assert (cache / "tiny-random-v1" / "config.json").is_file()  # built on first use, in the user cache
    assert list(work.iterdir()) == []  # nothing in the working directory
