"""Planner accuracy on the CPU, per phase: planned vs measured host memory on the tiny model and on the
logits-heavy one (Qwen2.5's 151,936 vocabulary on the tiny body), each config in a fresh process.

For every config: `Lab.load()`, then `--steps` steps; the measured peak of a phase is the process's
RSS peak during it (the Lab's sampler at 200 Hz), the largest over the steps after the first (the
first step adds one-off state for good: lazily imported code, thread pools, oneDNN caches, which the
plan's "Python, torch, libraries" line includes). Planned: `plan(cfg).devices["host"].phase_peak(phase)`
= resident items + that phase's transients; the total is the device's planned peak against the
measured peak of the whole step.

    .venv/bin/python bench/planner_accuracy.py                      # both presets, several shapes
    .venv/bin/python bench/planner_accuracy.py --worker tiny-cpu    # one config, one JSON line
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import warnings
from pathlib import Path

MiB = 1024 ** 2
PHASES = ("rollout", "logprobs", "backward")
CASES = [
    ("tiny-cpu", []),
    ("tiny-cpu", ["grpo.micro_batch_size=8", "generator.max_completion_length=128"]),
    ("logits-heavy-cpu", []),
    ("logits-heavy-cpu", ["grpo.logprob_chunk_size=512"]),
    ("logits-heavy-cpu", ["generator.max_completion_length=512"]),
]


def worker(preset: str, overrides: list[str], steps: int) -> dict:
    from grpo_lab import Lab, load_config
    from grpo_lab.planner import plan

    cfg = load_config(preset, overrides + ["memory.sample_hz=200"])
    host = plan(cfg).devices["host"]
    lab = Lab(cfg).load()
    measured = {}
    for i in range(steps):
        result = lab.step()
        if i == 0:
            continue   # one-off state of the first step (see the docstring)
        for row in result.memory:
            if row["metric"] == "rss" and row["phase"] in PHASES:
                measured[row["phase"]] = max(measured.get(row["phase"], 0), row["peak"])
    lab.close()
    planned = {p: host.phase_peak(p) for p in PHASES}
    return {"preset": preset, "overrides": overrides, "planned": planned, "measured": measured,
            "planned_total": host.total, "measured_total": max(measured.values()),
            "transients": {p: planned[p] - host.resident for p in PHASES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help="run one preset in this process and print JSON")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", help="write every row here too")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.worker:
        print(json.dumps(worker(args.worker, args.set, args.steps)))
        return
    rows = []
    for preset, overrides in CASES:
        cmd = [sys.executable, __file__, "--worker", preset, "--steps", str(args.steps),
               *[a for o in overrides for a in ("--set", o)]]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print("| config | phase | planned MiB | measured peak RSS MiB | measured / planned |")
    print("|---|---|---|---|---|")
    for r in rows:
        name = " ".join([r["preset"], *r["overrides"]])
        for phase in PHASES:
            p, m = r["planned"][phase], r["measured"][phase]
            print(f"| {name} | {phase} | {p / MiB:.0f} | {m / MiB:.0f} | {m / p:.2f} |")
        print(f"| {name} | **total** | {r['planned_total'] / MiB:.0f} | {r['measured_total'] / MiB:.0f} | "
              f"**{r['measured_total'] / r['planned_total']:.2f}** |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
