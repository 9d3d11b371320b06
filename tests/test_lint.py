"""The linter reads every Python file in the repository (issue 41: `grpo_lab/dist/` sat in ruff's default exclude list,
so none of its files was ever checked), and finds nothing."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")

pytestmark = pytest.mark.skipif(
    RUFF is None or not (ROOT / ".git").exists(), reason="needs ruff (dev extra) and a git checkout"
)


def tracked_python() -> set[str]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {line for line in out.splitlines() if (ROOT / line).exists()}


def test_ruff_reads_every_tracked_python_file():
    out = subprocess.run([RUFF, "check", "--show-files", "."], cwd=ROOT, capture_output=True, text=True).stdout
    read = {str(Path(line.strip()).resolve().relative_to(ROOT)) for line in out.splitlines() if line.strip()}
    missing = sorted(tracked_python() - read)
    assert not missing, f"ruff skips {len(missing)} tracked files, e.g. {missing[:5]}"


def test_ruff_finds_nothing():
    run = subprocess.run([RUFF, "check", "--quiet", "."], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:]
