r"""A tool loop's rollout planned turn by turn against each turn's measured host peak, on Qwen2.5's 152k vocabulary on
the tiny body (builtin:qwen2-152k, float32, 8 rows). Each rollout in a fresh process (its first step: nothing
warmed): every row's tool call forced in each turn but the last (the tiny body never writes one; bench/forced.py),
the tool answering `--answer-words` words, the last turn free to the trajectory budget. The turns' tokens (prefilled,
in the KV cache, decoded) are the hf backend's record of its generate() calls, one a turn (Rollout.turn_shapes); the
plan (planner/turns.py turn_peaks) takes them; the measured peak is the step's `turn_memory` host RSS of each "turn k"
mark (the sampler at 200 Hz).

    OMP_NUM_THREADS=1 python -m bench.plan_accuracy.turn_plan                       # 2 and 4 turns, keep and prefill
    OMP_NUM_THREADS=1 python -m bench.plan_accuracy.turn_plan --baseline            # TOOLS_IMPORTS' measurement

Prints one JSON line per turn and a summary line; docs/benchmarks.md "A tool loop's plan, turn by turn" keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MiB = 1024**2
ROOT = Path(__file__).resolve().parents[2]


def lab_config(turns: int, length: int, mode: str, mmap, model: str = "builtin:qwen2-152k") -> dict:
    return {
        "model": {"name_or_path": model, "dtype": "float32", "bnb_4bit_compute_dtype": "float32",
                  "chat_template": "trl:qwen2_5"},
        "generator": {"max_completion_length": length, "max_prompt_length": 1024, "temperature": 1.0,
                      "max_tool_calling_iterations": turns - 1, "turn_cache": mode},
        "grpo": {"num_generations": 4, "prompts_per_step": 2, "beta": 0.0},
        "memory": {"sample_hz": 200, "host_mmap_threshold_mib": mmap},
    }  # fmt: skip


def turns_made(shapes: list[dict]):
    """The rollout's Turns from its generate() calls' shapes (Rollout.turn_shapes: rows, tokens prefilled, context,
    decoded), each labelled with its turn's mark."""
    from grpo_lab.planner.turns import Turn

    return [Turn(int(s["mark"].split()[1]), s["rows"], s["prefill"], s["context"], s["decode"]) for s in shapes]


def worker(turns: int, length: int, mode: str, words: int, mmap) -> list[dict]:
    from bench.probes import turn_cache as probe
    from grpo_lab import Lab
    from grpo_lab.planner.turns import turn_bytes, turn_peaks

    probe.ANSWER_WORDS[0] = words
    lab = Lab(lab_config(turns, length, mode, mmap), reward_funcs=["length"], tools=[probe.lookup]).load()
    probe.force_calls(lab.learner.tokenizer, turns - 1)
    plan = lab.plan()
    result = lab.step()
    made_turns = turns_made(lab.generator.turns.shapes)  # (the tool loop's latest episode: this step's rollout)
    lab.close()
    planned = turn_peaks(plan, made_turns)
    measured = {r["mark"]: r["peak"] for r in result.turn_memory if r["device"] == "host" and r["metric"] == "rss"}
    rows = []
    for t, p in zip(made_turns, planned):
        m = measured[f"turn {t.number}"]
        terms = {k: round(v / MiB, 1) for k, v in turn_bytes(plan.shape, plan.config, t).items()}
        rows.append({"turns": turns, "turn_cache": mode, "mmap": mmap, "turn": t.number, "rows": t.rows,
                     "prefill": t.prefill, "context": t.context, "decode": t.decode, "terms_mib": terms,
                     "planned_mib": round(p / MiB, 1), "measured_mib": round(m / MiB, 1),
                     "plan_over_measured": round(p / m, 3)})  # fmt: skip
    return rows


def baseline_one(name: str) -> float:
    """One fresh process's RSS (MiB) as its first generate() call starts: `name` plain or tools."""
    import grpo_lab.generation.hf as hf
    from bench.probes import turn_cache as probe
    from grpo_lab import Lab

    seen, original = [], hf.HFGenerator.generate_chunk

    def first(self, *args, **kwargs):
        seen.append(int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
        return original(self, *args, **kwargs)

    hf.HFGenerator.generate_chunk = first
    tools = {"tools": [probe.lookup]} if name == "tools" else {}
    lab = Lab(lab_config(2, 64, "keep", 0.125), reward_funcs=["length"], **tools).load()
    lab.rollout()
    lab.close()
    return seen[0] / MiB


def run(cmd: list[str]) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    return out.stdout.strip().splitlines()


def one(turns: int, length: int, mode: str, words: int, mmap) -> list[dict]:
    """worker() in a fresh process."""
    cmd = [sys.executable, "-m", "bench.plan_accuracy.turn_plan", "--worker", str(turns), str(length), mode,
           str(words), json.dumps(mmap)]  # fmt: skip
    return json.loads(run(cmd)[-1])


# (turns, trajectory budget, tool answer words): each forced turn writes ~64 tokens, each 8-word answer ~25
CASES = [(2, 512, 8), (4, 512, 8)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--baseline", action="store_true")
    parser.add_argument("--modes", nargs="+", default=["keep", "prefill"])
    parser.add_argument("--mmap", nargs="+", default=["null", "0.125"], help="memory.host_mmap_threshold_mib values")
    args = parser.parse_args(argv)
    if args.worker:
        turns, length, mode, words, mmap = args.worker
        print(json.dumps(worker(int(turns), int(length), mode, int(words), json.loads(mmap))))
        return
    if args.baseline:
        print(json.dumps({name: round(baseline_one_fresh(name), 1) for name in ("plain", "tools")}))
        return
    ratios = []
    for mmap in map(json.loads, args.mmap):
        for mode in args.modes:
            for turns, length, words in CASES:
                for row in one(turns, length, mode, words, mmap):
                    print(json.dumps(row), flush=True)
                    ratios.append(row["plan_over_measured"])
    print(json.dumps({"summary": {"min": min(ratios), "max": max(ratios),
                                  "within_0.9_1.1": all(0.9 <= r <= 1.1 for r in ratios)}}))  # fmt: skip


def baseline_one_fresh(name: str) -> float:
    code = f"from bench.plan_accuracy.turn_plan import baseline_one; print(baseline_one({name!r}))"
    return float(run([sys.executable, "-c", code])[-1])


if __name__ == "__main__":
    main()
