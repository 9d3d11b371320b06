"""A tool-calling run killed mid-run (SIGKILL inside a tool call, in the middle of a step's turns) continues with
`grpo-lab run --resume DIR` to the same metrics as an uninterrupted run: `tiny-tools` (its model calls its calculator
by itself), small. Slow: it builds builtin:tiny-tools once per session (minutes)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from test_resume import read_metrics, training

from grpo_lab.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tiny_tools")]
STEPS = 3
RUN = [
    "tiny-tools",
    "--quiet",
    *("--set", "grpo.prompts_per_step=2", "--set", "grpo.num_generations=4", "--set", "grpo.micro_batch_size=8"),
    *("--set", "run.save_every=1", "--steps", str(STEPS)),
]
# in the child: the calculator, wrapped (its name, hints and docstring kept), SIGKILLs the process at its first call
# once a step has been written: inside a tool turn of a later step
KILL_IN_A_TOOL = """
import functools, os, signal, sys
from pathlib import Path
import grpo_lab.data.calculator as calc
real = calc.calculator
@functools.wraps(real)
def calculator(expression: str) -> str:
    metrics = Path(sys.argv[-1]) / "metrics.jsonl"
    if metrics.is_file() and metrics.read_text().count("\\n") >= 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(expression)
calc.calculator = calculator
"""


def test_a_run_killed_inside_a_tool_call_resumes_to_the_same_metrics(tmp_path, user_cache):
    straight = tmp_path / "straight"
    assert main(["run", *RUN, "--out", str(straight)]) == 0
    rows = read_metrics(straight)
    assert sum(r["tool_calls_per_row"] for r in rows) > 0  # the model does call its tool
    out = tmp_path / "killed"
    code = KILL_IN_A_TOOL + f"from grpo_lab.cli import main\nsys.exit(main({['run', *RUN, '--out', str(out)]!r}))\n"
    child = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=900)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert 1 <= len(read_metrics(out)) < STEPS  # killed mid-run
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    assert training(read_metrics(out)) == training(rows)
