"""The hf rollout's decode paths side by side on this machine (issue 39's CPU part): tokens per second of one Lab's
rollout with generator.hf_decode dynamic, static and merged, alternated on the same prompts (a restart rewinds the
step's prompts), with the sampler-learner log-prob mismatch each path's samples leave (the metric the lab logs) and
the host's peak RSS in the rollout against the plan's. CUDA graphs (compiled, and merged on a GPU) and TRL's HF
generation beside it are the GPU check's (bench/gpu/gpu_check.py).

    python -m bench.probes.rollout_paths                                    # Qwen2.5-0.5B's shape, float32, CPU
    python -m bench.probes.rollout_paths --lengths 32 128 --rounds 3

Prints one JSON line per path and length (median tokens/s over `--rounds`); docs/benchmarks.md "The rollout copy"
keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

PATHS = ("dynamic", "static", "merged")


def learner_gap(lab, rollout) -> float:
    """Mean |learner - sampler| log-prob over the sampled tokens (StepResult.logprob_mismatch's definition)."""
    import torch

    from grpo_lab.algo.logprobs import completion_logprobs, precision, rollout_slice

    model = lab.executor.learner.model
    with torch.no_grad(), precision(model):
        learner = completion_logprobs(model, *rollout_slice(rollout, slice(None), lab.executor.learner.device)).float()
    mask = rollout.completion_mask.bool()
    return float((learner - rollout.sampler_logprobs).abs()[mask].mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:qwen2.5-0.5b-random")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--rounds", type=int, default=3, help="rollouts per path and length, alternated")
    parser.add_argument("--sequences", type=int, default=8)
    args = parser.parse_args()

    import torch

    from grpo_lab import Lab
    from grpo_lab.planner import plan

    for length in args.lengths:
        lab = Lab(
            "tiny-cpu",
            overrides=[
                f"model.name_or_path={args.model}",
                f"model.dtype={args.dtype}",
                f"model.bnb_4bit_compute_dtype={args.dtype}",
                "lora.r=8",
                "lora.target_modules=all-linear",
                "memory.sample_hz=20",
                f"generator.max_completion_length={length}",
                "grpo.prompts_per_step=1",
                f"grpo.num_generations={args.sequences}",
                "grpo.beta=0.0",
            ],
        ).load()
        with torch.no_grad():  # moved LoRA weights: the merge and the mismatch have something to show
            g = torch.Generator().manual_seed(0)
            for name, p in lab.executor.learner.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.01)
        seconds: dict[str, list[float]] = {p: [] for p in PATHS}
        mismatch: dict[str, list[float]] = {p: [] for p in PATHS}
        peaks: dict[str, float] = {}
        tokens = {}
        lab.rollout()  # warm-up
        for _ in range(args.rounds):
            for path in PATHS:
                lab.configure({"generator.hf_decode": path})
                first = len(lab.memory.phase_rows)
                start = time.perf_counter()
                rollout = lab.rollout()
                seconds[path].append(time.perf_counter() - start)
                tokens[path] = int(rollout.completion_mask.sum())
                rows = [r for r in lab.memory.phase_rows[first:] if r["device"] == "host" and r["metric"] == "rss"]
                peaks[path] = max([peaks.get(path, 0.0)] + [r["peak"] for r in rows])
                mismatch[path].append(learner_gap(lab, rollout))
        for path in PATHS:
            lab.configure({"generator.hf_decode": path})
            planned = plan(lab.config).devices["host"].phase_peak("rollout")
            print(
                json.dumps(
                    {
                        "length": length,
                        "path": path,
                        "tokens": tokens[path],
                        "tokens_per_s": round(tokens[path] / statistics.median(seconds[path]), 1),
                        "seconds": [round(s, 2) for s in seconds[path]],
                        "logprob_mismatch": statistics.median(mismatch[path]) if mismatch[path] else None,
                        "rollout_peak_rss_mib": round(peaks[path] / 2**20, 1),
                        "planned_rollout_peak_mib": round(planned / 2**20, 1),
                    }
                ),
                flush=True,
            )
        lab.close()


if __name__ == "__main__":
    main()
