"""What the rollout copy (generator.hf_decode: merged) costs to build, and which way to refresh it after a step (issue
39): dequantize the nf4 base again and add the LoRA delta (what grpo_lab does, nothing kept between rollouts), or keep
the dequantized base and add only the new delta (a "re-merge": one more dense copy of every linear held between
rollouts). Times each part over every linear layer of the learner, median of `--repeats`, and the bytes each way holds.

    python -m bench.probes.rollout_copy                      # Qwen2.5-0.5B's shape (random weights), CPU, float32
    python -m bench.probes.rollout_copy --model builtin:qwen2.5-7b-random:layers=2 --dtype bfloat16

Prints one JSON line per part; docs/benchmarks.md "The rollout copy" keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs (one warm-up first)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:qwen2.5-0.5b-random")
    parser.add_argument("--dtype", default="float32", help="the compute dtype (the copy's)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import bitsandbytes.functional as bnbf

    from grpo_lab import Lab
    from grpo_lab.generation.rollout_copy import dense_weight, merged_copy

    dtype = getattr(torch, args.dtype)
    lab = Lab(
        "tiny-cpu",
        overrides=[
            f"model.name_or_path={args.model}",
            f"model.bnb_4bit_compute_dtype={args.dtype}",
            "memory.sample_hz=0",
            "lora.target_modules=all-linear",
        ],
    ).load()
    model = lab.executor.learner.model
    layers = [m for m in model.modules() if hasattr(m, "base_layer") and hasattr(m.base_layer.weight, "quant_state")]
    params = sum(m.base_layer.weight.quant_state.shape.numel() for m in layers)

    def dequantize():
        for m in layers:
            bnbf.dequantize_4bit(m.base_layer.weight.data, m.base_layer.weight.quant_state).to(dtype)

    def deltas():
        for m in layers:
            m.get_delta_weight(m.active_adapters[0])

    kept = [bnbf.dequantize_4bit(m.base_layer.weight.data, m.base_layer.weight.quant_state).float() for m in layers]

    def remerge():  # the kept float32 base + the new delta (added in place into a copy, as dense_weight adds it)
        for m, base in zip(layers, kept):
            name = m.active_adapters[0]
            a, b = m.lora_A[name].weight.float(), m.lora_B[name].weight.float()
            base.clone().addmm_(b, a, alpha=m.scaling[name]).to(dtype)

    def rebuild():  # what grpo_lab does at each rollout
        for m in layers:
            dense_weight(m, dtype)

    with torch.no_grad():
        parts = {
            "dequantize nf4": timed(dequantize, args.repeats),
            "LoRA deltas (PEFT's get_delta_weight: B @ A, a new tensor)": timed(deltas, args.repeats),
            "rebuild: dequantize + delta + cast (grpo_lab)": timed(rebuild, args.repeats),
            "re-merge: kept base + delta + cast": timed(remerge, args.repeats),
            "whole copy (merged_copy)": timed(lambda: merged_copy(model, dtype), args.repeats),
        }
    element = torch.tensor([], dtype=dtype).element_size()
    for part, seconds in parts.items():
        print(json.dumps({"part": part, "seconds": round(seconds, 4), "model": args.model, "dtype": args.dtype}))
    print(
        json.dumps(
            {
                "linear_params": params,
                "copy_bytes": params * element,
                "re-merge keeps between rollouts (bytes)": params * 4,
                "threads": torch.get_num_threads(),
            }
        )
    )
    lab.close()


if __name__ == "__main__":
    main()
