"""What a process that plans costs before any model memory, per kind of process: a plain Python process with a Lab,
`grpo-lab run`, a Jupyter kernel with a Lab (a person's, its live plot drawn; a headless one, as papermill runs it,
before any figure; a headless one after a figure, lab.memory_snapshot(), after step 0), and a CPU rank of a sharded
learner (under Ray). Each is a fresh process:
it loads tiny-cpu (the random built-in), takes two steps, and its baseline is its RSS as step 1's rollout starts (the
first step's one-off state in, the heap trimmed: every phase starts so) less what the plan puts beside the baseline in
that process (the tiny model's weights, LoRA, AdamW, the rollback copy: a few MiB). The planner's lines are
PROCESS_BASELINE (grpo_lab/planner/estimate.py).

    python -m bench.probes.process_baseline              # 2 rounds of every kind
    python -m bench.probes.process_baseline --rounds 3 --kinds process,run

Prints one JSON line per process and a summary line (medians); docs/benchmarks.md "What a process costs" keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 1024**2
KINDS = ("process", "run", "kernel", "headless", "headless-figure", "rank")
KERNELS = ("kernel", "headless", "headless-figure")  # run in a Jupyter kernel (the last two without a live frontend)
ROOT = Path(__file__).resolve().parents[2]


def overrides(kind: str) -> list[str]:
    from grpo_lab.models.source import resolve_model_path

    sets = [f"model.name_or_path={resolve_model_path('builtin:tiny-random')}"]
    return sets + (["placement.learner_procs=2"] if kind == "rank" else [])


def beside_baseline(kind: str) -> tuple[float, float]:
    """(the plan's resident bytes beside the baseline in this kind's process, its planned baseline), from plan()."""
    from grpo_lab import load_config
    from grpo_lab.planner import plan

    planned = plan(load_config("tiny-cpu", overrides(kind)))
    device = next(iter(planned.ranks.values())) if kind == "rank" else planned.devices["host"]
    ours = ("Python, torch", "Jupyter kernel", "figures:", "live plot:")  # (a kernel: planner/kernel_share.py)
    base = [i for i in device.items if i.phase is None and i.what.startswith(ours)]
    baseline = sum(i.bytes for i in base)
    return device.resident - baseline, baseline


def rss_at_second_rollout(rows: list[dict], device: str) -> float:
    return next(r["start"] for r in rows if r["phase"] == "rollout" and r["device"] == device and r["metric"] == "rss")


def measure(kind: str) -> dict:
    """In this process (kind process or kernel): load, two steps, the reading."""
    from grpo_lab import Lab, load_config

    lab = Lab(load_config("tiny-cpu", overrides(kind))).load()
    if kind in KERNELS:
        lab.memory_plot()  # why: a person's live plot imports anywidget and plotly (a headless kernel makes none)
    lab.step()
    if kind == "headless-figure":
        lab.memory_snapshot()  # why: a headless kernel draws its figures as PNGs (plotly, then matplotlib)
    lab.step()
    extra = {}
    if kind == "rank":
        from grpo_lab.execution.sharded.processes import driver_memory

        rss = statistics.median(rss_at_second_rollout(lab.memory.rows_for(1), f"rank{k}/host") for k in (0, 1))
        tree = driver_memory(lab.executor.ranks.pids)["tree"]  # the driver's process tree: Ray's own processes
        extra = {
            "ray_processes_mib": round(tree["Ray's own processes"], 1),
            "driver_mib": round(tree["driver (this process)"], 1),
        }
    else:
        rss = rss_at_second_rollout(lab.memory.rows_for(1), "host")
    lab.close()
    return {**reading(kind, rss), **extra}


def reading(kind: str, rss: float) -> dict:
    others, planned = beside_baseline(kind)
    return {
        "kind": kind,
        "rss_mib": round(rss / MiB, 1),
        "beside_mib": round(others / MiB, 1),
        "baseline_mib": round((rss - others) / MiB, 1),
        "planned_baseline_mib": round(planned / MiB, 1),
    }


def run_cli() -> dict:
    """`grpo-lab run` in a process of its own: the reading of its metrics.jsonl (each step's memory rows)."""
    with tempfile.TemporaryDirectory() as out:
        sets = [a for s in overrides("run") for a in ("--set", s)]
        cmd = [sys.executable, "-m", "grpo_lab", "run", "tiny-cpu", *sets, "--steps", "2", "--out", f"{out}/run"]
        subprocess.run(cmd, check=True, capture_output=True, env=env())
        steps = [json.loads(line) for line in Path(f"{out}/run/metrics.jsonl").read_text().splitlines()]
    return reading("run", rss_at_second_rollout(steps[1]["memory"], "host"))


def run_kernel(kind: str = "kernel") -> dict:
    """A Jupyter kernel (ipykernel, as a notebook's): `measure(kind)` executed in it; a headless kind's cell is sent
    without stdin, as papermill sends it (runtime.frontend_is_live: no live frontend)."""
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3", cwd=str(ROOT), env=env())
    try:
        code = f"import json; from bench.probes.process_baseline import measure; print(json.dumps(measure({kind!r})))"
        said, live = [], kind == "kernel"
        client.execute_interactive(code, output_hook=lambda m: said.append(m), timeout=900, allow_stdin=live)
        text = "".join(m["content"].get("text", "") for m in said if m["msg_type"] == "stream")
        return json.loads(text.strip().splitlines()[-1])
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def env() -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": path}


def one(kind: str) -> dict:
    if kind == "run":
        return run_cli()
    if kind in KERNELS:
        return run_kernel(kind)
    out = subprocess.run(
        [sys.executable, "-m", "bench.probes.process_baseline", "--child", kind],
        capture_output=True,
        text=True,
        check=True,
        env=env(),
        cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--child", choices=("process", "rank"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    kinds, rows = args.kinds.split(","), []
    for _ in range(args.rounds):
        for kind in kinds:  # why alternated: a machine's drift falls on every kind alike
            rows.append(one(kind))
            print(json.dumps(rows[-1]), flush=True)
    summary = {
        kind: {
            k: round(statistics.median(r[k] for r in rows if r["kind"] == kind), 1)
            for k in ("rss_mib", "baseline_mib", "planned_baseline_mib")
        }
        for kind in kinds
    }
    print(json.dumps({"summary": summary, "rounds": args.rounds}))


if __name__ == "__main__":
    main()
