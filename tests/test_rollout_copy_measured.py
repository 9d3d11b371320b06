"""The merged rollout's plan against what a learner measures (issue 71): with the copy kept and released, the rollout
phase's peak RSS within 0.9-1.1 of the plan, and what a kept copy adds between steps (what the next rollout starts
from) too.
Measured as bench/plan_accuracy/planner_accuracy.py measures every CPU point: one process per config (RSS peaks are
per process), the step after the first (which adds one-off state), the heap's mmap threshold pinned so that RSS is
live memory. The model is `builtin:layers-heavy` in float32 (16 layers of 16.8M weights on a small vocabulary), so the
copy (1 GiB) is half of what the process holds: a kept copy planned as the rollout's alone, or a released one that
stayed, misses the difference between steps by the whole copy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [
    "model.name_or_path=builtin:layers-heavy",
    "model.dtype=float32",
    "model.bnb_4bit_compute_dtype=float32",
    "generator.hf_decode=merged",
    "generator.max_prompt_length=64",
    "generator.max_completion_length=32",
    "grpo.num_generations=4",
    "grpo.prompts_per_step=1",
    "grpo.micro_batch_size=4",
]


def measure(copy: str) -> dict:
    """One bench worker's record (planned and measured per phase, and at rest) with the copy kept or released."""
    overrides = [*SETTINGS, f"generator.rollout_copy={copy}"]
    script = ROOT / "bench" / "plan_accuracy" / "planner_accuracy.py"
    cmd = [sys.executable, str(script), "--worker", "tiny-cpu", "--steps", "2"]
    done = subprocess.run(
        cmd + [a for o in overrides for a in ("--set", o)], capture_output=True, text=True, cwd=ROOT, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # (a 513 MB model quantized at load and two steps, twice: ~4-7 min a config on 2 busy cores)
def test_the_rollout_and_what_a_kept_copy_holds_between_steps_measure_what_the_plan_says(user_cache):
    """Each mode's rollout phase within 0.9-1.1 of its plan; between steps the kept copy's Lab holds the copy more
    than the released one's, measured as planned (a copy-independent ~80 MiB at rest, the same in both modes and
    outside this plan's lines, is left out by the difference: 1.05 kept and 1.12 released alone, measured)."""
    records = {copy: measure(copy) for copy in ("keep", "release")}
    for copy, record in records.items():
        copy_line = next(i for i in record["items"] if i[0] == "rollout copy (LoRA merged)")
        assert copy_line[2] == (None if copy == "keep" else "rollout")  # the plan measured is the one meant
        rollout = record["measured"]["rollout"] / record["planned"]["rollout"]
        assert 0.9 <= rollout <= 1.1, (copy, rollout, record["measured"], record["planned"])
    keep, release = records["keep"], records["release"]
    held = keep["measured_rest"] - release["measured_rest"]
    planned = keep["planned_rest"] - release["planned_rest"]
    assert planned >= 2**30 and 0.9 <= held / planned <= 1.1, (held / 2**20, planned / 2**20)
