"""The CPU rollout's host memory with and without grpo_lab's heap trims, on the logits-heavy preset.

Each variant in a fresh process: `Lab.load()`, `--steps` steps with the Lab's sampler at 500 Hz; prints, per step,
the rollout phase's RSS peak above its start and its absolute peak, the step's RSS peak and the step time. `untrimmed`
swaps grpo_lab's trim_host_heap for a no-op in that process only (before every phase and every TRIM_EVERY decoding
steps): what glibc's heap does on its own.

    .venv/bin/python bench/plan_accuracy/rollout_heap.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import warnings

MiB = 1024**2


def worker(variant: str, steps: int) -> dict:
    if variant == "untrimmed":
        import grpo_lab.generation.hf as hf
        import grpo_lab.memory.heap as heap

        heap.trim_host_heap = hf.trim_host_heap = lambda: False
    from grpo_lab import Lab, load_config

    lab = Lab(load_config("logits-heavy-cpu", ["memory.sample_hz=500"])).load()
    rises, peaks, step_peaks, seconds = [], [], [], []
    for _ in range(steps):
        result = lab.step()
        rss = [r for r in result.memory if r["metric"] == "rss"]
        row = next(r for r in rss if r["phase"] == "rollout")
        rises.append((row["peak"] - row["start"]) / MiB)
        peaks.append(row["peak"] / MiB)
        step_peaks.append(max(r["peak"] for r in rss) / MiB)
        seconds.append(result.step_seconds)
    lab.close()
    return {
        "variant": variant,
        "rollout_rise_mib": rises,
        "rollout_peak_mib": peaks,
        "step_peak_mib": step_peaks,
        "step_seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("trimmed", "untrimmed"))
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps)))
        return
    print(
        "| variant | rollout RSS peak above its start (MiB) | rollout RSS peak (MiB) | step RSS peak (MiB) | "
        "step seconds |"
    )
    print("|---|---|---|---|---|")
    for variant in ("untrimmed", "trimmed"):
        out = subprocess.run(
            [sys.executable, __file__, "--worker", variant, "--steps", str(args.steps)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        r = json.loads(out.strip().splitlines()[-1])
        cells = [", ".join(f"{v:.0f}" for v in r[k]) for k in ("rollout_rise_mib", "rollout_peak_mib", "step_peak_mib")]
        print(f"| {variant} | {' | '.join(cells)} | {', '.join(f'{v:.1f}' for v in r['step_seconds'])} |")


if __name__ == "__main__":
    main()
