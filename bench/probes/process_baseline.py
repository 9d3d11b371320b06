"""What a process that steps costs before any model memory: a fresh interpreter loads tiny-cpu (the random built-in),
takes one step and trims its heap, once as grpo_lab runs it and once with TRL's trainer utilities imported first (what
the advantages' nanstd imported until 2026-12-01), alternated. The planner's libraries line is HOST_BASELINE
(grpo_lab/planner/estimate.py).

    python -m bench.probes.process_baseline              # 3 rounds
    python -m bench.probes.process_baseline --rounds 5

Prints one JSON line per process and a summary line (medians); docs/benchmarks.md "What a process costs" keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, sys, time
start = time.perf_counter()
import psutil
from grpo_lab import Lab, load_config
from grpo_lab.memory.heap import trim_host_heap
from grpo_lab.models.source import resolve_model_path
if sys.argv[1] == "with-trl":
    import trl.trainer.utils  # noqa: F401
lab = Lab(load_config("tiny-cpu", [f"model.name_or_path={resolve_model_path('builtin:tiny-random')}"])).load()
lab.step()
trim_host_heap()
print(json.dumps({"seconds": time.perf_counter() - start, "rss_mib": psutil.Process().memory_info().rss / 2**20}))
"""
WAYS = ("grpo_lab", "with-trl")


def one(way: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = subprocess.run([sys.executable, "-c", CHILD, way], capture_output=True, text=True, check=True, env=env)
    return {"way": way, **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    rows = []
    for _ in range(rounds):
        for way in WAYS:  # why alternated: a machine's drift falls on both ways alike
            rows.append(one(way))
            print(json.dumps(rows[-1]), flush=True)
    summary = {
        way: {k: round(statistics.median(r[k] for r in rows if r["way"] == way), 2) for k in ("seconds", "rss_mib")}
        for way in WAYS
    }
    print(json.dumps({"summary": summary, "rounds": rounds}))


if __name__ == "__main__":
    main()
