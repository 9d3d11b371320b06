"""generator.drop_finished_rows against one call to the end (issue 50), side by side in one process: each rollout
samples the same rows with the same seeds, off and on in alternating order after one warm-up rollout, `--repeats`
times each, so both see the same machine. Prints one JSON line per rollout (seconds, completion tokens, tokens per
second, generate() calls) and a summary line with the medians and their ratio; the sampled tokens must be equal
(checked, else exit 1).

    python -m bench.probes.rows_leaving                       # tiny-random, 16 rows x up to 256 tokens, sampled
    python -m bench.probes.rows_leaving --model builtin:qwen2-152k --length 128

docs/benchmarks.md "Finished rows leave the batch" keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:tiny-random")
    parser.add_argument("--length", type=int, default=256, help="generator.max_completion_length")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import grpo_lab.generation.leaving as leaving
    from grpo_lab import Lab

    calls = []
    real = leaving.LeaveAtBucket
    leaving.LeaveAtBucket = lambda *a: calls.append(a[2]) or real(*a)
    lab = Lab(
        {
            "model": {"name_or_path": args.model, "dtype": "float32", "bnb_4bit_compute_dtype": "float32"},
            "generator": {"max_completion_length": args.length, "temperature": 1.0},
            "grpo": {"num_generations": args.generations, "prompts_per_step": args.prompts},
        }
    ).load()
    times, tokens = {False: [], True: []}, {}
    try:
        lab.rollout()  # warm-up: the first rollout's one-off costs are neither side's
        for repeat in range(args.repeats):
            order = (False, True) if repeat % 2 == 0 else (True, False)  # why alternate: neither side always second
            for leave in order:
                lab.configure({"generator.drop_finished_rows": leave})
                calls.clear()
                torch.manual_seed(repeat)  # the rows' seeds: the same rollout both ways
                start = time.perf_counter()
                out = lab.rollout()
                seconds = time.perf_counter() - start
                n = int(out.completion_mask.sum())
                times[leave].append(seconds)
                tokens.setdefault(repeat, []).append(out.completion_ids)
                line = {"repeat": repeat, "drop_finished_rows": leave, "seconds": round(seconds, 3), "tokens": n}
                print(json.dumps({**line, "tokens_per_s": round(n / seconds, 1), "calls": len(calls)}))
    finally:
        lab.close()
    equal = all(torch.equal(a, b) for a, b in tokens.values())
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(json.dumps({"model": args.model, "rows": args.prompts * args.generations, "length": args.length,
                      "median_s_off": round(off, 3), "median_s_on": round(on, 3), "speedup": round(off / on, 2),
                      "same_tokens": equal}))  # fmt: skip
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
