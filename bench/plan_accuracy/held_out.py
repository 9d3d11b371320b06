r"""The host plan at its peak on configs the planner was not tuned on, each as a user runs it: `grpo-lab run` in a fresh
process (its first run: nothing warmed), its measured peak the highest host RSS of any phase of its steps (its
metrics.jsonl's per-phase rows, the sampler at the config's rate and at every phase's start and end), against the
plan's host peak (`plan(config).devices["host"].total`), planned in this process as the run plans it. Goal: every
ratio 0.9-1.1.

    python -m bench.plan_accuracy.held_out                 # every config below, 2 steps each
    python -m bench.plan_accuracy.held_out --only 32k-mmap-default --steps 3

Prints one JSON line per config and a summary line; docs/benchmarks.md "The host plan on held-out configs" keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 1024**2
ROOT = Path(__file__).resolve().parents[2]
# (name, preset, overrides): vocabularies, lengths, micro-batches and heap settings none of the planner's measured
# terms came from (the grid in planner_accuracy.py varies one axis at a time around its bases, the mmap pinned)
CONFIGS = [
    (
        "152k-mmap-default-8x256",
        "logits-heavy-cpu",
        ["model.dtype=float32", "model.bnb_4bit_compute_dtype=float32", "memory.host_mmap_threshold_mib=null"],
    ),
    (
        "32k-mmap-default",
        "tiny-cpu",
        [
            "model.name_or_path=builtin:qwen2-32k",
            "generator.max_completion_length=160",
            "grpo.num_generations=6",
            "grpo.micro_batch_size=3",
            "memory.host_mmap_threshold_mib=null",
        ],
    ),
    (
        "152k-mmap-1mib-chunked",
        "logits-heavy-cpu",
        [
            "model.dtype=float32",
            "model.bnb_4bit_compute_dtype=float32",
            "generator.max_completion_length=320",
            "grpo.num_generations=4",
            "grpo.micro_batch_size=2",
            "grpo.logprob_chunk_size=128",
            "memory.host_mmap_threshold_mib=1",
        ],
    ),
]


def planned_peak(preset: str, sets: list[str]) -> tuple[float, str]:
    """The plan's host peak (bytes) and its phase, as `grpo-lab run` plans this config."""
    from grpo_lab import load_config
    from grpo_lab.planner import plan

    host = plan(load_config(preset, sets)).devices["host"]
    return host.total, host.peak_phase or "resident"


def measured_peak(preset: str, sets: list[str], steps: int) -> tuple[float, str]:
    """`grpo-lab run` in its own process: the highest host RSS of any phase of its steps (bytes) and that phase."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.TemporaryDirectory() as out:
        flags = [a for s in sets for a in ("--set", s)]
        cmd = [sys.executable, "-m", "grpo_lab", "run", preset, *flags, "--steps", str(steps), "--out", f"{out}/run"]
        subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
        rows = [
            r
            for line in Path(f"{out}/run/metrics.jsonl").read_text().splitlines()
            for r in json.loads(line)["memory"]
            if r["device"] == "host" and r["metric"] == "rss"
        ]
    top = max(rows, key=lambda r: r["peak"])
    return top["peak"], top["phase"]


def one(name: str, preset: str, sets: list[str], steps: int) -> dict:
    planned, planned_phase = planned_peak(preset, sets)
    measured, phase = measured_peak(preset, sets, steps)
    return {
        "config": name,
        "preset": preset,
        "overrides": sets,
        "steps": steps,
        "planned_mib": round(planned / MiB, 1),
        "planned_phase": planned_phase,
        "measured_mib": round(measured / MiB, 1),
        "measured_phase": phase,
        "plan_over_measured": round(planned / measured, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", help="one config by name")
    args = parser.parse_args()
    rows = []
    for name, preset, sets in CONFIGS:
        if args.only in (None, name):
            rows.append(one(name, preset, sets, args.steps))
            print(json.dumps(rows[-1]), flush=True)
    ratios = [r["plan_over_measured"] for r in rows]
    print(
        json.dumps(
            {
                "summary": {
                    "min": min(ratios),
                    "max": max(ratios),
                    "within_0.9_1.1": all(0.9 <= r <= 1.1 for r in ratios),
                }
            }
        )
    )


if __name__ == "__main__":
    main()
