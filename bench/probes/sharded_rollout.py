"""Sample once vs the replicated rollout: the hf rollout's wall time through a learner sharded over 2 CPU ranks, when
each rank samples its share of the prompt groups and the ranks all-gather (sample once, the default), and when every
rank samples the whole batch (the rollout before issue 23; forced by GRPO_LAB_REPLICATED_ROLLOUT=1 in that Lab's
ranks, read by generation/sample_once.py and nowhere else). Issue 23's target: sample once <= 0.6 x replicated.

Both Labs are loaded side by side (4 rank processes; the idle Lab's ranks wait on their pipe) and their rollouts
alternate, so machine noise falls on both; each rollout is timed in the driver (command, sampling, gather, checksum,
reply), medians reported. Both sample the same completions (checked).

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.probes.sharded_rollout --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings


def main() -> None:
    from grpo_lab import Lab, load_config
    from grpo_lab.generation.sample_once import REPLICATED

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config",
        default="logits-heavy-cpu",
        help="logits-heavy-cpu: 8 x 256 tokens over Qwen2.5's vocabulary, where sampling cost is per row",
    )
    parser.add_argument("--rounds", type=int, default=5, help="rollouts per condition, alternated")
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    # why 2 prompts x 4 (the preset has 1 x 8): ranks share whole groups, so one group would leave rank 1 idle;
    # why sample_hz 0: four ranks' samplers would add noise to timings that compare sampling alone
    overrides = [
        "placement.learner_procs=2",
        "grpo.prompts_per_step=2",
        "grpo.num_generations=4",
        "memory.sample_hz=0",
        *args.set,
    ]
    cfg = load_config(args.config, overrides)
    labs = {}
    for name, flag in (("sample once", None), ("replicated", "1")):
        os.environ.pop(REPLICATED, None) if flag is None else os.environ.update({REPLICATED: flag})
        labs[name] = Lab(load_config(args.config, overrides)).load()  # its ranks inherit the environment now
    os.environ.pop(REPLICATED, None)
    try:
        for lab in labs.values():
            lab.rollout()  # warm-up (first-call costs: kernels, allocator)
        times = {name: [] for name in labs}
        rollouts, rows = {}, {}
        for _ in range(args.rounds):
            for name, lab in labs.items():
                before = [r["generated_rows"] for r in lab.inspect()]
                t0 = time.perf_counter()
                rollouts[name] = lab.rollout()
                times[name].append(time.perf_counter() - t0)
                rows[name] = [r["generated_rows"] - b for r, b in zip(lab.inspect(), before)]
        same = all(r.completions == rollouts["sample once"].completions for r in rollouts.values())
    finally:
        for lab in labs.values():
            lab.close()
    med = {name: statistics.median(t) for name, t in times.items()}
    g = cfg.grpo
    print(
        f"{args.config} {' '.join(args.set)}: {g.prompts_per_step} prompt(s) x {g.num_generations}, "
        f"{cfg.generator.max_completion_length} tokens, gather_for_generation={cfg.generator.gather_for_generation}, "
        f"{args.rounds} rounds; the last rounds' completions equal: {same}"
    )
    for name, t in times.items():
        print(
            f"  {name:12s} median {med[name]:7.2f} s   rows sampled per rank {rows[name]}   "
            f"(each: {', '.join(f'{x:.2f}' for x in t)})"
        )
    paired = statistics.median(a / b for a, b in zip(times["sample once"], times["replicated"]))
    print(
        f"  ratio sample once / replicated: {med['sample once'] / med['replicated']:.2f} of the medians, "
        f"{paired:.2f} the median of each round's (target <= 0.6)"
    )


if __name__ == "__main__":
    main()
