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

`--variants` runs each point as this tree's code (`this`), with the hf log-prob recorder as it was swapped in for that
process (`per-step`: a [rows] tensor kept per decoding step instead of one [rows, steps] buffer), or as another
checkout's code (`base`, the tree `--base` names, e.g. `git archive faac7ae | tar -x -C /tmp/base`: its own worker),
alternated point by point; "vs" in the table is against `base` where there is one:

    git archive faac7ae | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 python -m bench.plan_accuracy.threshold_sweep --runs 3 --thresholds null \
        --variants this base --base /tmp/base --out bench/results/recorder_heap_cpu_2026-12-05c/sweep.jsonl
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


def per_step_columns() -> None:
    """The hf log-prob recorder as it was: each step's [rows] log-probs a tensor of its own, kept to the call's end."""
    import torch

    from grpo_lab.generation.sampling import SampledLogprobs

    def record(self, tokens):
        if not self.count:
            self.columns = []
        self.columns.append(self.previous.gather(-1, tokens).squeeze(-1))
        self.count += 1

    finish = SampledLogprobs.finish

    def finished(self, new_tokens):
        if self.previous is not None and self.count < new_tokens.shape[1]:
            record(self, new_tokens[:, -1:].to(self.previous.device))
        columns, self.previous, self.columns, self.count = getattr(self, "columns", []), None, [], 0
        return torch.stack(columns, 1) if columns else finish(self, new_tokens)

    SampledLogprobs._record, SampledLogprobs.finish = record, finished


def worker(name: str, mmap, variant: str = "this") -> dict:
    if variant == "per-step":
        per_step_columns()
    steps = timed_steps()
    if CONFIGS[name] is None:
        from bench.plan_accuracy.turn_plan import worker as turns

        rows = turns(2, 512, "keep", 8, mmap)
        ratios = {f"turn {r['turn']}": r["plan_over_measured"] for r in rows}
        return {"config": name, "mmap": mmap, "variant": variant, "turns": rows, "ratios": ratios, "steps": steps}
    from bench.plan_accuracy.planner_accuracy import worker as phases

    preset, sets, n = CONFIGS[name]
    sets = [*sets, f"memory.host_mmap_threshold_mib={json.dumps(mmap)}"]
    r = phases(preset, sets, n)
    ratios = {p: round(r["planned"][p] / m, 3) for p, m in r["measured"].items()}
    ratios["total"] = round(r["planned_total"] / r["measured_total"], 3)
    return {"config": name, "mmap": mmap, "variant": variant, "ratios": ratios, "steps": steps,
            "planned_mib": {p: round(v / MiB, 1) for p, v in r["planned"].items()},
            "measured_mib": {p: round(v / MiB, 1) for p, v in r["measured"].items()},
            "planned_total_mib": round(r["planned_total"] / MiB, 1),
            "measured_total_mib": round(r["measured_total"] / MiB, 1)}  # fmt: skip


def one(name: str, mmap, run: int, variant: str = "this", base: str = "") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "bench.plan_accuracy.threshold_sweep", "--worker", name, json.dumps(mmap)]
    root = Path(base) if variant == "base" else ROOT  # (base: that tree's own worker, which takes no variant)
    cmd += [] if variant == "base" else [variant]
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**env, "PYTHONPATH": str(root)}, cwd=root)
    if done.returncode != 0:
        return {
            "config": name,
            "mmap": mmap,
            "variant": variant,
            "run": run,
            "failed": done.stderr.strip().splitlines()[-1][:300],
        }
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row.update(
        variant=variant, run=run, process_s=round(time.time() - start, 1), load=[round(x, 2) for x in os.getloadavg()]
    )
    return row


def seconds(row: dict) -> tuple[float, float]:
    """The process's wall and CPU seconds per step: the steps after the first (one step: the tool rollout's)."""
    steps = row["steps"][1:] or row["steps"]
    return (sum(s["step_s"] for s in steps) / len(steps), sum(s["cpu_s"] for s in steps) / len(steps))


def variant_of(row: dict) -> str:
    return row.get("variant", "this")  # (lines from before --variants: the code of their day)


def table(path: str) -> None:
    """A markdown row per (config, threshold, variant): the plan, measured peaks, plan / measured range (over phases
    or turns, and the step's peak alone), seconds against glibc's own threshold (as `base`'s code, if it ran)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "failed" not in r]
    both = "variant" in rows[0]
    print(
        "| config | threshold MiB |" + (" code |" if both else "") + " plan MiB | measured peak MiB | plan / "
        "measured (min-max) |" + (" at the peak |" if both else "") + " s / step | CPU s | vs null (wall / CPU) |"
    )
    print("|---" * (8 + 2 * both) + "|")
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]
        against = "base" if any(variant_of(r) == "base" for r in mine) else "this"
        base = [seconds(r) for r in mine if r["mmap"] is None and variant_of(r) == against]
        for key in dict.fromkeys((r["mmap"], variant_of(r)) for r in mine):
            own = [r for r in mine if (r["mmap"], variant_of(r)) == key]
            ratios = [v for r in own for v in r["ratios"].values()]
            if "turns" in own[0]:
                plan = ", ".join(f"{t['planned_mib']:.0f}" for t in own[0]["turns"])
                peaks = "; ".join(", ".join(f"{t['measured_mib']:.0f}" for t in r["turns"]) for r in own)
                top = [min(r["ratios"].values()) for r in own]  # (each turn's own peak is planned)
            else:
                plan = f"{own[0]['planned_total_mib']:.0f}"
                peaks = ", ".join(f"{r['measured_total_mib']:.0f}" for r in own)
                top = [r["ratios"]["total"] for r in own]
            wall = [seconds(r)[0] for r in own]
            cpu = [seconds(r)[1] for r in own]
            vs = [sum(x) / len(x) / (sum(b[i] for b in base) / len(base)) for i, x in enumerate((wall, cpu))]
            times = ["/".join(f"{x:.2f}" for x in xs) for xs in (wall, cpu)]
            cells = [name, "null" if key[0] is None else key[0], *([key[1]] if both else []), plan, peaks,
                     f"{min(ratios):.3f}-{max(ratios):.3f}", *([f"{min(top):.3f}-{max(top):.3f}"] if both else []),
                     *times, f"{vs[0]:.2f} / {vs[1]:.2f}"]  # fmt: skip
            print("| " + " | ".join(map(str, cells)) + " |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--first-run", type=int, default=1, help="the first run's number (a later sweep's lines)")
    parser.add_argument("--thresholds", nargs="+", default=["null", "0.125", "1", "4", "16"])
    parser.add_argument("--variants", nargs="+", default=["this"], choices=["this", "per-step", "base"])
    parser.add_argument("--base", default="", help="the checkout `base` runs (its own worker and code)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", help="append every line here too")
    parser.add_argument("--table", help="print the markdown table of a sweep's lines (a file --out wrote)")
    args = parser.parse_args(argv)
    if args.table:
        table(args.table)
        return
    if args.worker:
        print(json.dumps(worker(args.worker[0], json.loads(args.worker[1]), *args.worker[2:])))
        return
    for run in range(args.first_run, args.first_run + args.runs):
        for name in args.configs:
            for mmap in map(json.loads, args.thresholds):
                for variant in args.variants:
                    line = json.dumps(one(name, mmap, run, variant, args.base))
                    print(line, flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(line + "\n")


if __name__ == "__main__":
    main()
