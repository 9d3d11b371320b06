r"""The host plan at the defaults on configs it was not fitted on (issue 34, item 13): each config's `grpo-lab run`
in a process of its own, its peak RSS (the kernel's ru_maxrss for that process) against the plan's host peak
(`plan(cfg).devices["host"].total`), at every default setting but the config's own fields.

    .venv/bin/python -m bench.plan_accuracy.host_plan_defaults       # the three held-out configs, 3 steps, 2 runs each
    .venv/bin/python -m bench.plan_accuracy.host_plan_defaults --compare  # and each without the per-layer heap trims
    .venv/bin/python -m bench.plan_accuracy.host_plan_defaults --only 32k-beta --steps 2 --repeats 1

Prints one row per config and a markdown table (docs/benchmarks.md keeps the last one).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1024**2
# name -> --set overrides of the tiny-cpu preset (float32 compute, nf4 + LoRA, the hf generator, glibc's own
# mmap threshold: memory.host_mmap_threshold_mib null)
CONFIGS = {
    # the issue's: Qwen2.5's vocabulary on the tiny body, 1 x 8 x 256, one micro-batch of 8
    "152k-mb8": [
        "model.name_or_path=builtin:qwen2-152k",
        "generator.max_completion_length=256",
        "grpo.prompts_per_step=1",
        "grpo.num_generations=8",
        "grpo.micro_batch_size=8",
    ],
    # a Llama-size vocabulary with a reference model (beta > 0: the logprobs phase scores the reference)
    "32k-beta": [
        "model.name_or_path=builtin:qwen2-32k",
        "generator.max_completion_length=384",
        "grpo.prompts_per_step=2",
        "grpo.num_generations=4",
        "grpo.beta=0.04",
    ],
    # 16-bit compute (the preset's is float32): bf16 weights and nf4 computing in bf16, micro-batches of 4
    "32k-bf16": [
        "model.name_or_path=builtin:qwen2-32k",
        "model.dtype=bfloat16",
        "model.bnb_4bit_compute_dtype=bfloat16",
        "generator.max_completion_length=128",
        "grpo.prompts_per_step=1",
        "grpo.num_generations=8",
        "grpo.micro_batch_size=4",
    ],
}


def planned_peak(overrides: list[str]) -> float:
    from grpo_lab import load_config
    from grpo_lab.planner import plan

    return plan(load_config("tiny-cpu", overrides)).devices["host"].total


# `grpo-lab run` as a process of its own; `layer_trims` False: without the per-layer heap trims (the comparison)
RUN = (
    "import sys, grpo_lab.models.learner as learner; from grpo_lab.cli import main\n"
    "if sys.argv[1] == 'off': learner.trim_before_each_layer = lambda layers: []\n"
    "sys.exit(main(sys.argv[2:]))"
)


def measured_peak(overrides: list[str], steps: int, layer_trims: bool = True) -> tuple[int, float]:
    """`grpo-lab run tiny-cpu` with the overrides: (its peak RSS in bytes, wall seconds)."""
    with tempfile.TemporaryDirectory(prefix="grpo-lab-heldout-") as out:
        cmd = [sys.executable, "-c", RUN, "on" if layer_trims else "off"]
        cmd += ["run", "tiny-cpu", "--steps", str(steps), "--quiet", "--out", out]
        cmd += [a for o in overrides for a in ("--set", o)]
        t0 = time.perf_counter()
        with open(Path(out) / "stderr.txt", "w+") as err:  # why a file: a full pipe would stall the run
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
            _, status, usage = os.wait4(proc.pid, 0)  # why wait4: this child's own peak RSS, not all children's
            if os.waitstatus_to_exitcode(status):
                err.seek(0)
                raise SystemExit(f"{' '.join(cmd)} failed: {err.read().strip().splitlines()[-1:]}")
        return usage.ru_maxrss * 1024, time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--set", action="append", default=[], help="one more override for every config")
    parser.add_argument("--repeats", type=int, default=2, help="runs per config and way (heap holes vary by run)")
    parser.add_argument("--compare", action="store_true", help="each run also without the per-layer heap trims")
    args = parser.parse_args()
    rows = [
        "| config | per-layer trims | planned peak (MiB) | peak RSS (MiB), each run | worst / planned | s/run |",
        "|---|---|---|---|---|---|",
    ]
    for name in args.only:
        overrides = CONFIGS[name] + args.set
        planned = planned_peak(overrides)
        for trims in (True, False) if args.compare else (True,):
            runs = [measured_peak(overrides, args.steps, trims) for _ in range(args.repeats)]
            peaks = [m for m, _ in runs]
            ratio = max(peaks) / planned
            each = ", ".join(f"{m / MiB:,.0f}" for m in peaks)
            print(f"{name:<10} trims {str(trims):<5} planned {planned / MiB:5.0f} MiB  runs {each} MiB  {ratio:.2f}x")
            seconds = sum(t for _, t in runs) / len(runs)
            way = "yes" if trims else "no"
            rows.append(f"| {name} | {way} | {planned / MiB:,.0f} | {each} | {ratio:.2f} | {seconds:.0f} |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
