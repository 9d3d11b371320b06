"""Does `tiny-tools` learn to use its calculator? `grpo-lab run tiny-tools` per seed, with the tool and without it
(the control: `generator.tools=[]`, the same model, prompts and rewards), each run a fresh process: the correctness
reward (`exact_answer`) and the tool calls per row (TRL's tools/call_frequency), the first 3 steps' mean and the last
3 steps', and the wall seconds.

    OMP_NUM_THREADS=1 python -m bench.probes.tiny_tools_learns                      # seeds 0-4, tool and control
    OMP_NUM_THREADS=1 python -m bench.probes.tiny_tools_learns --seeds 0 --arms tool --out FILE

Prints one JSON line per run and a summary line (per arm: each seed's correctness rise and the tool calls' rise).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = {"tool": [], "control": ["--set", "generator.tools=[]"]}  # arm -> its --set lines


def mean3(values: list[float]) -> tuple[float, float]:
    return sum(values[:3]) / 3, sum(values[-3:]) / 3


def one(seed: int, arm: str, where: Path, sets: list[str]) -> dict:
    out = where / f"{arm}-{seed}"
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "grpo_lab.cli", "run", "tiny-tools", "--quiet", "--set", f"run.seed={seed}", "--out",
         str(out), *ARMS[arm], *sets],
        check=True,
        stdout=subprocess.DEVNULL,  # why: the run's step lines; its metrics.jsonl has them
    )  # fmt: skip
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    right = mean3([r["rewards/exact_answer/mean"] for r in rows])
    calls = mean3([r.get("tool_calls_per_row") or 0.0 for r in rows])
    return {
        "seed": seed,
        "arm": arm,
        "steps": len(rows),
        "seconds": round(seconds, 1),
        "correct_first3": round(right[0], 3),
        "correct_last3": round(right[1], 3),
        "correct_rise": round(right[1] - right[0], 3),
        "calls_first3": round(calls[0], 3),
        "calls_last3": round(calls[1], 3),
        "calls_rise": round(calls[1] - calls[0], 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(5)))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--set", dest="sets", action="append", default=[], help="one more --set for every run")
    parser.add_argument("--out", type=Path, help="append the JSON lines to this file")
    args = parser.parse_args(argv)
    sets = [x for s in args.sets for x in ("--set", s)]
    lines = []
    with tempfile.TemporaryDirectory(prefix="grpo-lab-tiny-tools.") as where:
        for seed in args.seeds:
            for arm in args.arms if seed % 2 == 0 else args.arms[::-1]:  # why: neither arm always goes first
                lines.append(one(seed, arm, Path(where), sets))
                print(json.dumps(lines[-1]), flush=True)
    summary = {
        arm: {
            "correct_rises": {r["seed"]: r["correct_rise"] for r in lines if r["arm"] == arm},
            "calls_rises": {r["seed"]: r["calls_rise"] for r in lines if r["arm"] == arm},
            "correct_last3": {r["seed"]: r["correct_last3"] for r in lines if r["arm"] == arm},
        }
        for arm in args.arms
    }
    print(json.dumps({"summary": summary}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as sink:
            sink.write("".join(json.dumps(r) + "\n" for r in [*lines, {"summary": summary}]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
