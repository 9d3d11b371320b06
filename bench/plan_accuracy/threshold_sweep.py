r"""The host plan and the CPU step's time at pinned glibc mmap thresholds against glibc's own, on configs whose RSS
carries heap holes at glibc's own (issue 68). Each (config, threshold, run) in a fresh process (the threshold is
process-wide): the existing benches' workers (planner_accuracy.py's per-phase plan / measured, turn_plan.py's per
turn) with each step's wall seconds, phase seconds and the process's CPU seconds beside.

    OMP_NUM_THREADS=1 python -m bench.plan_accuracy.threshold_sweep --runs 2 \
        --thresholds null 0.125 1 4 16 --out bench/results/threshold_sweep_cpu_2026-12-05/sweep.jsonl
    python -m bench.plan_accuracy.threshold_sweep --table bench/results/threshold_sweep_cpu_2026-12-05/sweep.jsonl

Configs: `152k-f32` (held_out.py's 152k-mmap-default-8x256: logits-heavy-cpu in float32, 3 steps, the first left
out of the peaks as planner_accuracy.py does), `tiny-cpu` (the preset, 6 steps, likewise), `tools-2turn-keep`
(turn_plan.py's 2-turn keep rollout: one step, each turn's peak). One JSON line per process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MiB = 1024**2
ROOT = Path(__file__).resolve().parents[2]
F32 = ["model.dtype=float32", "model.bnb_4bit_compute_dtype=float32"]
CONFIGS = {"152k-f32": ("logits-heavy-cpu", F32, 3), "tiny-cpu": ("tiny-cpu", [], 6), "tools-2turn-keep": None}


def timed_steps() -> list[dict]:
    """Wrap Lab.step so every step records its wall, phase and process-CPU seconds."""
    from grpo_lab import Lab

    seen, step = [], Lab.step

    def wrapped(self, *args, **kwargs):
        cpu = time.process_time()
        result = step(self, *args, **kwargs)
        seen.append({"step_s": round(result.step_seconds, 2), "cpu_s": round(time.process_time() - cpu, 2),
                     "phase_s": {k: round(v, 2) for k, v in result.phase_seconds.items()}})  # fmt: skip
        return result

    Lab.step = wrapped
    return seen


def worker(name: str, mmap) -> dict:
    steps = timed_steps()
    if CONFIGS[name] is None:
        from bench.plan_accuracy.turn_plan import worker as turns

        rows = turns(2, 512, "keep", 8, mmap)
        ratios = {f"turn {r['turn']}": r["plan_over_measured"] for r in rows}
        return {"config": name, "mmap": mmap, "turns": rows, "ratios": ratios, "steps": steps}
    from bench.plan_accuracy.planner_accuracy import worker as phases

    preset, sets, n = CONFIGS[name]
    sets = [*sets, f"memory.host_mmap_threshold_mib={json.dumps(mmap)}"]
    r = phases(preset, sets, n)
    ratios = {p: round(r["planned"][p] / m, 3) for p, m in r["measured"].items()}
    ratios["total"] = round(r["planned_total"] / r["measured_total"], 3)
    return {"config": name, "mmap": mmap, "ratios": ratios, "steps": steps,
            "planned_mib": {p: round(v / MiB, 1) for p, v in r["planned"].items()},
            "measured_mib": {p: round(v / MiB, 1) for p, v in r["measured"].items()},
            "planned_total_mib": round(r["planned_total"] / MiB, 1),
            "measured_total_mib": round(r["measured_total"] / MiB, 1)}  # fmt: skip


def one(name: str, mmap, run: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "bench.plan_accuracy.threshold_sweep", "--worker", name, json.dumps(mmap)]
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        return {"config": name, "mmap": mmap, "run": run, "failed": done.stderr.strip().splitlines()[-1][:300]}
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row.update(run=run, process_s=round(time.time() - start, 1), load=[round(x, 2) for x in os.getloadavg()])
    return row


def seconds(row: dict) -> tuple[float, float]:
    """The process's wall and CPU seconds per step: the steps after the first (one step: the tool rollout's)."""
    steps = row["steps"][1:] or row["steps"]
    return (sum(s["step_s"] for s in steps) / len(steps), sum(s["cpu_s"] for s in steps) / len(steps))


def table(path: str) -> None:
    """A markdown row per (config, threshold): the plan, measured peaks, plan / measured range, seconds vs null."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "failed" not in r]
    head = "| config | threshold MiB | plan MiB | measured peak MiB | plan / measured (min-max) | s / step | CPU s |"
    print(head + " vs null (wall / CPU) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in dict.fromkeys(r["config"] for r in rows):
        base = [seconds(r) for r in rows if r["config"] == name and r["mmap"] is None]
        for mmap in dict.fromkeys(r["mmap"] for r in rows if r["config"] == name):
            own = [r for r in rows if r["config"] == name and r["mmap"] == mmap]
            ratios = [v for r in own for v in r["ratios"].values()]
            if "turns" in own[0]:
                plan = ", ".join(f"{t['planned_mib']:.0f}" for t in own[0]["turns"])
                peaks = "; ".join(", ".join(f"{t['measured_mib']:.0f}" for t in r["turns"]) for r in own)
            else:
                plan = f"{own[0]['planned_total_mib']:.0f}"
                peaks = ", ".join(f"{r['measured_total_mib']:.0f}" for r in own)
            wall = [seconds(r)[0] for r in own]
            cpu = [seconds(r)[1] for r in own]
            vs = [sum(x) / len(x) / (sum(b[i] for b in base) / len(base)) for i, x in enumerate((wall, cpu))]
            times = ["/".join(f"{x:.2f}" for x in xs) for xs in (wall, cpu)]
            cells = [name, "null" if mmap is None else mmap, plan, peaks, f"{min(ratios):.3f}-{max(ratios):.3f}",
                     *times, f"{vs[0]:.2f} / {vs[1]:.2f}"]  # fmt: skip
            print("| " + " | ".join(map(str, cells)) + " |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--first-run", type=int, default=1, help="the first run's number (a later sweep's lines)")
    parser.add_argument("--thresholds", nargs="+", default=["null", "0.125", "1", "4", "16"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", help="append every line here too")
    parser.add_argument("--table", help="print the markdown table of a sweep's lines (a file --out wrote)")
    args = parser.parse_args(argv)
    if args.table:
        table(args.table)
        return
    if args.worker:
        print(json.dumps(worker(args.worker[0], json.loads(args.worker[1]))))
        return
    for run in range(args.first_run, args.first_run + args.runs):
        for name in args.configs:
            for mmap in map(json.loads, args.thresholds):
                line = json.dumps(one(name, mmap, run))
                print(line, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(line + "\n")


if __name__ == "__main__":
    main()
