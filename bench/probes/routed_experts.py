"""One decoding step through one mixture-of-experts layer of Qwen3-30B-A3B's shape (128 experts of width 768, hidden
2048, top-8; random nf4 weights, double-quantized scales, bfloat16): every expert dequantized (bitsandbytes'
parametrization, transformers' grouped_mm) against the routed experts alone (models/routed_experts.py). Prints the
experts and bytes dequantized per step, the median seconds of each, their ratios, and the largest output difference.

    OMP_NUM_THREADS=1 python -m bench.probes.routed_experts --rows 8 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def one_layer(dtype=torch.bfloat16):
    """A Qwen3-30B-A3B experts module with random weights, its fused experts quantized as the lab quantizes them."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from grpo_lab.config.models_and_devices import ModelSection
    from grpo_lab.models.bundled import BUNDLED, bundled_name
    from grpo_lab.models.experts import quantize_experts
    from grpo_lab.models.routed_experts import use_routed_experts

    hf = json.loads((BUNDLED / f"{bundled_name('Qwen/Qwen3-30B-A3B')}.json").read_text())
    config = Qwen3MoeConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "transformers_version")})
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    for name in ("gate_up_proj", "down_proj"):  # the layer's experts in 16-bit (1.1 GiB), then quantized
        experts._parameters[name] = torch.nn.Parameter(torch.randn(experts._parameters[name].shape, dtype=dtype) * 0.02)
    quantize_experts(experts, ModelSection(name_or_path="-", dtype="bfloat16"), recurse=False)
    experts.requires_grad_(False)
    use_routed_experts(experts)
    return experts, config


def median_seconds(call, rounds: int) -> float:
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def timed(experts, config, implementation: str, hidden, index, weights, rounds: int):
    config._experts_implementation = implementation
    seconds, out = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        with torch.no_grad():
            out = experts(hidden, index, weights)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="sequences in the decoding step (one token each)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    from grpo_lab.models.experts import EXPERT_PARAMS
    from grpo_lab.models.routed_experts import ROUTED, dequantize_experts

    experts, config = one_layer()
    k, count = config.num_experts_per_tok, config.num_experts
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(args.rows, config.hidden_size, generator=g, dtype=torch.bfloat16)
    index = torch.stack([torch.randperm(count, generator=g)[:k] for _ in range(args.rows)])  # [rows, top-k]
    weights = torch.softmax(torch.randn(args.rows, k, generator=g), -1).to(torch.bfloat16)
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size * 2  # bytes of one expert in bfloat16
    whole_s, whole = timed(experts, config, "grouped_mm", hidden, index, weights, args.rounds)
    before = experts.experts_dequantized
    routed_s, routed = timed(experts, config, ROUTED, hidden, index, weights, args.rounds)
    routed_n = (experts.experts_dequantized - before) // args.rounds
    print(f"rows {args.rows} x top-{k} of {count} experts, one layer, bfloat16, median of {args.rounds}")
    print(f"whole layer: {count} experts, {count * per_expert / 2**30:.3f} GiB dequantized, {whole_s:.3f} s")
    print(f"routed only: {routed_n} experts, {routed_n * per_expert / 2**30:.3f} GiB dequantized, {routed_s:.3f} s")
    print(f"ratio routed/whole: bytes {routed_n / count:.3f}, time {routed_s / whole_s:.3f}")
    ids = torch.unique(index)
    whole_d = median_seconds(lambda: [getattr(experts, n) for n in EXPERT_PARAMS], args.rounds)
    routed_d = median_seconds(lambda: [dequantize_experts(experts, n, ids) for n in EXPERT_PARAMS], args.rounds)
    print(f"dequantize alone: whole {whole_d:.3f} s, routed {routed_d:.3f} s, ratio {routed_d / whole_d:.3f}")
    print(f"largest output difference: {(whole.float() - routed.float()).abs().max().item():.3e}")


if __name__ == "__main__":
    main()
