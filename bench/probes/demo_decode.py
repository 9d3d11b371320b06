"""The main job (`grpo-lab run tiny-demo`) with its rollout decoded each way, alternated seed by seed, each run a fresh
`grpo-lab run` process: wall seconds, the steps' own seconds, and the correctness reward's rise (the last 3 steps'
mean over the first 3) that tests/test_demo_learns.py asserts. Why: the preset decodes from the rollout copy
(`generator.hf_decode: merged`); this is the figure behind that choice and the check that it learns as the default
path does.

    OMP_NUM_THREADS=1 python -m bench.probes.demo_decode                      # seeds 0-4, dynamic and merged
    OMP_NUM_THREADS=1 python -m bench.probes.demo_decode --seeds 0 --paths dynamic merged --out FILE

Prints one JSON line per run and a summary line (per path: median seconds, each seed's rise, merged / dynamic).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one(seed: int, path: str, where: Path) -> dict:
    out = where / f"{path}-{seed}"
    sets = ["--set", f"run.seed={seed}", "--set", f"generator.hf_decode={path}"]
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "grpo_lab.cli", "run", "tiny-demo", "--quiet", *sets, "--out", str(out)],
        check=True,
        stdout=subprocess.DEVNULL,  # why: the run's step lines; its metrics.jsonl has them
    )
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["rewards/exact_answer/mean"] for r in rows]
    first, last = sum(steps[:3]) / 3, sum(steps[-3:]) / 3
    return {
        "seed": seed,
        "path": path,
        "seconds": round(seconds, 1),
        "step_seconds": round(sum(r["step_seconds"] for r in rows), 1),
        "first3": round(first, 3),
        "last3": round(last, 3),
        "rise": round(last - first, 3),
        "steps": len(rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(5)))
    parser.add_argument("--paths", nargs="+", default=["dynamic", "merged"], help="generator.hf_decode values")
    parser.add_argument("--out", type=Path, help="append the JSON lines to this file")
    args = parser.parse_args(argv)
    lines = []
    with tempfile.TemporaryDirectory(prefix="grpo-lab-demo-decode.") as where:
        for seed in args.seeds:
            for path in args.paths if seed % 2 == 0 else args.paths[::-1]:  # why: neither path always goes first
                lines.append(one(seed, path, Path(where)))
                print(json.dumps(lines[-1]), flush=True)
    summary = {
        path: {
            "median_seconds": statistics.median(r["seconds"] for r in lines if r["path"] == path),
            "median_step_seconds": statistics.median(r["step_seconds"] for r in lines if r["path"] == path),
            "rises": {r["seed"]: r["rise"] for r in lines if r["path"] == path},
        }
        for path in args.paths
    }
    if len(args.paths) == 2:
        a, b = (summary[p]["median_seconds"] for p in args.paths)
        summary[f"{args.paths[1]} / {args.paths[0]}"] = round(b / a, 3)
    print(json.dumps({"summary": summary}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as sink:
            sink.write("".join(json.dumps(r) + "\n" for r in [*lines, {"summary": summary}]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
