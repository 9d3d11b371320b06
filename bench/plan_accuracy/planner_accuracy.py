r"""Planner accuracy on the CPU, per phase: planned vs measured host memory on the tiny model and on the
logits-heavy one (Qwen2.5's 151,936 vocabulary on the tiny body), each config in a fresh process.

For every config: `Lab.load()`, then `--steps` steps (5); the measured peak of a phase is the process's
RSS peak during it (the Lab's sampler at 200 Hz), the largest over the steps after the first (the
first step adds one-off state for good: lazily imported code and thread pools, which the plan's
"Python, torch, libraries" line includes, and a 16-bit CPU learner's oneDNN caches, its own line). Planned:
`plan(cfg).devices["host"].phase_peak(phase)` = resident items + that phase's transients; the total is the device's
planned peak against the measured peak of the whole step.

    .venv/bin/python bench/plan_accuracy/planner_accuracy.py               # the grid, the reported and held-out configs
    .venv/bin/python bench/plan_accuracy/planner_accuracy.py --vocab 32k --no-reported   # one vocabulary's grid points
    .venv/bin/python bench/plan_accuracy/planner_accuracy.py --vocab 32k \
        --set memory.host_mmap_threshold_mib=null   # the default
    .venv/bin/python bench/plan_accuracy/planner_accuracy.py --vocab 152k --quick --no-reported \
        --set memory.host_mmap_threshold_mib=null --trim-every 8
    .venv/bin/python bench/plan_accuracy/planner_accuracy.py --worker tiny-cpu    # one config, one JSON line
    python bench/plan_accuracy/planner_accuracy.py --device cuda:0          # on a GPU: the learner there, torch's
        # allocated peak per phase (reserved, NVML beside)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import warnings
from pathlib import Path

MiB = 1024**2
PHASES = ("rollout", "logprobs", "backward")
# the grid (issue 24): around one base per vocabulary, each axis moved on its own: completion length 64..1024,
# num_generations 2..16, micro-batch 1..8, beta 0 and > 0, checkpointing on and off, the hf and vllm backends
BASE = [
    "generator.max_prompt_length=64",
    "generator.max_completion_length=256",
    "grpo.prompts_per_step=1",
    "grpo.num_generations=8",
    "grpo.micro_batch_size=4",
    "grpo.beta=0.04",
    "model.gradient_checkpointing=true",
    "data.system_prompt=null",
    "generator.backend=hf",
]
AXES = {
    "generator.max_completion_length": [64, 1024],
    "grpo.num_generations": [2, 16],
    "grpo.micro_batch_size": [1, 8],
    "grpo.beta": [0.0],
    "model.gradient_checkpointing": ["false"],
    "generator.backend": ["vllm"],
}
VOCABS = {"32k": "builtin:qwen2-32k", "152k": "builtin:qwen2-152k"}
# the two configs the planner was not tuned on, as reported (1.58x and 1.18x before this grid)
REPORTED = [
    (
        "logits-heavy-cpu",
        [
            "generator.max_prompt_length=64",
            "grpo.num_generations=8",
            "grpo.prompts_per_step=1",
            "grpo.beta=0",
            "model.gradient_checkpointing=true",
        ],
    ),
    (
        "tiny-cpu",
        [
            "grpo.prompts_per_step=4",
            "grpo.num_generations=4",
            "generator.max_completion_length=192",
            "grpo.micro_batch_size=2",
            "grpo.beta=0.04",
            "model.gradient_checkpointing=false",
        ],
    ),
]
# held out: configs no term was measured on (the oneDNN and vLLM terms came from the grid's 32k points), off the
# grid's axes, float32 and 16-bit, both backends, with the system prompt on
HELD_OUT = [
    ("tiny-cpu", ["generator.backend=vllm"]),
    ("tiny-demo", ["model.gradient_checkpointing=true"]),  # why: as measured (2026-11-27), checkpointing
    (
        "logits-heavy-cpu",
        [
            "model.name_or_path=builtin:qwen2-32k",
            "generator.max_prompt_length=128",
            "generator.max_completion_length=384",
            "grpo.prompts_per_step=2",
            "grpo.num_generations=6",
            "grpo.micro_batch_size=3",
            "grpo.logprob_chunk_size=256",
            "grpo.beta=0.02",
        ],
    ),
]


def grid(vocabs=tuple(VOCABS)) -> list[tuple[str, list[str]]]:
    """(preset, overrides) of every grid point: the base per vocabulary, then each axis value on its own."""
    cases = []
    for model in (VOCABS[v] for v in vocabs):
        common = ["logits-heavy-cpu", [f"model.name_or_path={model}", *BASE]]
        cases.append((common[0], common[1]))
        for key, values in AXES.items():
            for value in values:
                micro = ["grpo.micro_batch_size=2"] if key == "grpo.num_generations" and value == 2 else []
                cases.append((common[0], [*common[1], f"{key}={value}", *micro]))
    return cases


# what is measured against the plan, per device kind: the first metric is the one the ratio is taken on
METRICS = {"host": ("rss",), "cuda": ("allocated", "reserved", "device_used")}


def worker(preset: str, overrides: list[str], steps: int, device: str = "host") -> dict:
    from grpo_lab import Lab, load_config
    from grpo_lab.planner import plan

    placed = [] if device == "host" else [f"placement.learner={device}"]
    # why the pinned threshold: host RSS then holds live memory, not heap holes (memory/heap.py); a point may
    # override it
    cfg = load_config(preset, ["memory.host_mmap_threshold_mib=0.125"] + overrides + placed + ["memory.sample_hz=200"])
    planned_device = plan(cfg).devices[device]
    metrics = METRICS["host" if device == "host" else "cuda"]
    lab = Lab(cfg).load()
    measured, rest = {m: {} for m in metrics}, 0.0
    for i in range(steps):
        result = lab.step()
        if i == 0:
            continue  # one-off state of the first step (see the docstring)
        for row in result.memory:
            if row["device"] != device or row["metric"] not in metrics or row["phase"] not in PHASES:
                continue
            per_phase = measured[row["metric"]]
            per_phase[row["phase"]] = max(per_phase.get(row["phase"], 0), row["peak"])
            if row["metric"] == metrics[0] and row["phase"] == "rollout":
                rest = max(rest, row["start"])  # memory at rest: what the step starts from
    lab.close()
    planned = {p: planned_device.phase_peak(p) for p in PHASES}
    return {
        "preset": preset,
        "overrides": overrides,
        "device": device,
        "metric": metrics[0],
        "planned": planned,
        "measured": measured[metrics[0]],
        "also": {m: measured[m] for m in metrics[1:]},  # on a GPU: torch's reserved and NVML's device-wide used
        "planned_total": planned_device.total,
        "measured_total": max(measured[metrics[0]].values()),
        "planned_rest": planned_device.resident,
        "measured_rest": rest,
        "transients": {p: planned[p] - planned_device.resident for p in PHASES},
        "items": [(i.what, i.bytes, i.phase) for i in planned_device.items],
    }


def short(override: str) -> str:
    """'grpo.beta=0.0' -> 'beta=0.0'."""
    key, _, value = override.partition("=")
    return f"{key.split('.')[-1]}={value}"


def label(preset: str, overrides: list[str]) -> str:
    """A grid point by what sets it apart: its vocabulary and the axis it moves (or the reported config)."""
    model = next((o.split("=")[1] for o in overrides if o.startswith("model.name_or_path=")), None)
    if (preset, overrides) in HELD_OUT:
        return f"{preset} (held out) " + " ".join(short(o) for o in overrides if "name_or_path" not in o)
    if model is None:
        return f"{preset} (reported) " + " ".join(short(o) for o in overrides)
    vocab = next(k for k, v in VOCABS.items() if v == model)
    moved = [short(o) for o in overrides[len(BASE) + 1 :] if not o.startswith("grpo.micro_batch_size=2")]
    return f"{vocab} " + (" ".join(moved) or "base")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help="run one preset in this process and print JSON")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        help="an override for every point, after the point's own "
        "(e.g. memory.host_mmap_threshold_mib=null: glibc's own threshold, the product's default)",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--trim-every",
        type=int,
        help="trim the CPU rollout's heap every N decoding steps (default: "
        "grpo_lab's own, generation/hf.py TRIM_EVERY)",
    )
    parser.add_argument("--json", help="write every row here too")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the base point and the two reported configs only (with --no-reported: the base point only)",
    )
    parser.add_argument(
        "--vocab",
        nargs="+",
        choices=list(VOCABS),
        default=list(VOCABS),
        help="the grid's vocabularies to run (default: both)",
    )
    parser.add_argument(
        "--no-reported", action="store_true", help="leave out the issue's two reported configs and the held-out ones"
    )
    parser.add_argument("--only-reported", action="store_true", help="the reported and held-out configs only")
    parser.add_argument(
        "--device",
        default="host",
        help="host (peak RSS, the default) or cuda:N: the learner on that "
        "GPU, measured as torch's allocated peak (reserved and NVML's used printed beside it)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.worker:
        if args.trim_every:
            import grpo_lab.generation.hf as hf

            hf.TRIM_EVERY = args.trim_every  # the CPU rollout's heap trim, every N decoding steps (memory/heap.py)
        print(json.dumps(worker(args.worker, args.set, args.steps, args.device)))
        return
    rows = []
    points = grid(args.vocab)
    extra = [] if args.no_reported else REPORTED + HELD_OUT
    if args.quick:  # the base point, and the reported configs unless --no-reported
        cases = points[:1] + ([] if args.no_reported else REPORTED)
    else:
        cases = extra if args.only_reported else points + extra
    what = "peak RSS" if args.device == "host" else f"{args.device} allocated peak"
    print(f"| grid point | phase | planned MiB | measured {what} MiB | measured / planned |")
    print("|---|---|---|---|---|", flush=True)
    for preset, overrides in cases:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            preset,
            "--steps",
            str(args.steps),
            "--device",
            args.device,
            *(["--trim-every", str(args.trim_every)] if args.trim_every else []),
            *[a for o in overrides + args.set for a in ("--set", o)],
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        name = label(preset, overrides)
        if done.returncode != 0:
            print(f"| {name} | failed | {done.stderr.strip().splitlines()[-1][:200]} | | |", flush=True)
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        r["name"] = name
        rows.append(r)
        print(
            f"| {name} | at rest | {r['planned_rest'] / MiB:.0f} | {r['measured_rest'] / MiB:.0f} | "
            f"{r['measured_rest'] / r['planned_rest']:.2f} |"
        )
        for phase in PHASES:
            p, m = r["planned"][phase], r["measured"][phase]
            print(f"| {name} | {phase} | {p / MiB:.0f} | {m / MiB:.0f} | {m / p:.2f} |")
            for metric, per_phase in r["also"].items():
                if phase in per_phase:
                    print(
                        f"| {name} | {phase} ({metric}) | {p / MiB:.0f} | {per_phase[phase] / MiB:.0f} | "
                        f"{per_phase[phase] / p:.2f} |"
                    )
        print(
            f"| {name} | **total** | {r['planned_total'] / MiB:.0f} | {r['measured_total'] / MiB:.0f} | "
            f"**{r['measured_total'] / r['planned_total']:.2f}** |",
            flush=True,
        )
    summary(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def summary(rows: list[dict]) -> None:
    """One line per grid point: measured / planned at rest, per phase and in total; then the range over all."""
    print("\n| grid point | at rest | rollout | logprobs | backward | total |\n|---|---|---|---|---|---|")
    ratios = []
    for r in rows:
        line = [
            r["measured_rest"] / r["planned_rest"],
            *(r["measured"][p] / r["planned"][p] for p in PHASES),
            r["measured_total"] / r["planned_total"],
        ]
        ratios += line
        print(f"| {r['name']} | " + " | ".join(f"{x:.2f}" for x in line) + " |")
    if ratios:
        print(f"\nmeasured / planned over {len(rows)} points: {min(ratios):.2f} to {max(ratios):.2f}")


if __name__ == "__main__":
    main()
