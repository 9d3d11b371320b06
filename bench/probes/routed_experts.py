"""One decoding step through one mixture-of-experts layer of Qwen3-30B-A3B's shape (128 experts of width 768, hidden
2048, top-8; random nf4 weights, double-quantized scales, bfloat16), three ways: every expert dequantized
(bitsandbytes' parametrization, transformers' grouped_mm), the routed experts alone dequantized
(models/routed_experts.py), and the routed experts' matmuls from their 4-bit codes (models/experts_gemv.py, here at
any tokens an expert). Prints, per batch, the experts and bytes dequantized, the median seconds of each way, their
ratios to the whole layer, the largest output differences, and a JSON line.

    OMP_NUM_THREADS=1 python -m bench.probes.routed_experts --rows 1 4 8 16 64 256 1024 4096 --rounds 5 --tiny-rollout
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

from grpo_lab.models.experts_gemv import GEMV_TOKENS, gemv_kernel


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


def timed(experts, config, implementation: str, hidden, index, weights, rounds: int):
    config._experts_implementation = implementation
    seconds, out = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        with torch.no_grad():
            out = experts(hidden, index, weights)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), out


@contextlib.contextmanager
def only(path: str):
    """The routed experts' forward `path` alone (routed_experts.EXPERT_PATHS); the fused one at any tokens an expert
    (experts_gemv.GEMV_TOKENS lifted, so larger batches show where it stops paying)."""
    from grpo_lab.models import experts_gemv, routed_experts

    paths = dict(routed_experts.EXPERT_PATHS)
    routed_experts.EXPERT_PATHS.clear()
    routed_experts.EXPERT_PATHS[path] = paths[path]
    experts_gemv.GEMV_TOKENS = 1 << 30
    try:
        yield
    finally:
        routed_experts.EXPERT_PATHS.clear()
        routed_experts.EXPERT_PATHS.update(paths)
        experts_gemv.GEMV_TOKENS = GEMV_TOKENS


@contextlib.contextmanager
def without(path: str):
    """The routed experts' forwards less `path` (routed_experts.EXPERT_PATHS), each at its own cut-off."""
    from grpo_lab.models import routed_experts

    paths = dict(routed_experts.EXPERT_PATHS)
    del routed_experts.EXPERT_PATHS[path]
    try:
        yield
    finally:
        routed_experts.EXPERT_PATHS.clear()
        routed_experts.EXPERT_PATHS.update(paths)


def one_batch(experts, config, rows: int, rounds: int) -> dict:
    """Every way through the layer for one batch of `rows` tokens: experts dequantized, seconds, largest difference."""
    from grpo_lab.models import experts_gemv
    from grpo_lab.models.routed_experts import ROUTED

    k, count = config.num_experts_per_tok, config.num_experts
    g = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, config.hidden_size, generator=g, dtype=torch.bfloat16)
    index = torch.stack([torch.randperm(count, generator=g)[:k] for _ in range(rows)])  # [rows, top-k]
    weights = torch.softmax(torch.randn(rows, k, generator=g), -1).to(torch.bfloat16)
    record = {"rows": rows, "top_k": k, "experts": count, "routed": torch.unique(index).numel()}
    record["max_tokens_per_expert"] = int(torch.bincount(index.reshape(-1)).max())
    record["whole_s"], whole = timed(experts, config, "grouped_mm", hidden, index, weights, rounds)
    with only("dequantize"):
        before = experts.experts_dequantized
        record["routed_s"], routed = timed(experts, config, ROUTED, hidden, index, weights, rounds)
        record["routed_dequantized"] = (experts.experts_dequantized - before) // rounds
    with only("gemv"):
        experts_gemv.blockwise(experts)  # (every expert's codes back blockwise: the first fused step permutes them)
        before, fused_before = experts.experts_dequantized, experts.experts_fused
        start = time.perf_counter()
        with torch.no_grad():
            experts(hidden, index, weights)
        record["fused_first_s"] = time.perf_counter() - start  # (permutes the routed experts' codes to the kernel's)
        record["fused_s"], fused = timed(experts, config, ROUTED, hidden, index, weights, rounds)
        record["fused_dequantized"] = (experts.experts_dequantized - before) // (rounds + 1)
        record["fused_experts"] = (experts.experts_fused - fused_before) // (rounds + 1)
    record["routed_diff"] = (whole.float() - routed.float()).abs().max().item()
    record["fused_diff"] = (fused.float() - routed.float()).abs().max().item()
    record["out_max"] = routed.float().abs().max().item()
    return record


def report(record: dict, per_expert: int) -> None:
    rows, count, whole = record["rows"], record["experts"], record["whole_s"]
    print(f"rows {rows} x top-{record['top_k']} of {count} experts: {record['routed']} routed, at most "
          f"{record['max_tokens_per_expert']} tokens an expert")  # fmt: skip
    ways = [("whole layer", count, whole), ("routed dequantize", record["routed_dequantized"], record["routed_s"])]
    for name, n, s in [*ways, ("fused 4-bit matmuls", record["fused_dequantized"], record["fused_s"])]:
        print(f"  {name}: {n} experts, {n * per_expert / 2**30:.3f} GiB dequantized, {s:.4f} s, "
              f"ratio bytes {n / count:.3f}, time {s / whole:.3f}")  # fmt: skip
    print(f"  fused: {record['fused_experts']} experts from their codes; first step {record['fused_first_s']:.4f} s "
          f"(permutes their codes); largest difference to routed {record['fused_diff']:.3e} (outputs up to "
          f"{record['out_max']:.3e}), routed to whole {record['routed_diff']:.3e}")  # fmt: skip
    print("JSON " + json.dumps(record))


def tiny_rollout(rounds: int) -> None:
    """builtin:tiny-moe in bfloat16, each way (fused, routed dequantize, held for the rollout): a Lab's rollout (8 rows
    x 32 tokens, sampled) timed, then 3 steps' learner-sampler log-prob mismatch (the learner's forward dequantizes;
    the sampler's decode may not)."""
    from grpo_lab import Lab

    knobs = ["model.name_or_path=builtin:tiny-moe", "model.dtype=bfloat16", "model.bnb_4bit_compute_dtype=bfloat16"]
    knobs += ["generator.max_completion_length=32", "grpo.num_generations=8", "grpo.prompts_per_step=1"]
    for path in ("gemv", "dequantize", "held"):
        torch.manual_seed(0)
        lab = Lab("tiny-cpu", overrides=knobs, reward_funcs=["length"]).load()
        chosen = {"gemv": without("held"), "dequantize": only("dequantize")}.get(path, contextlib.nullcontext())
        try:
            with chosen:  # (fused: at its own cut-off, the held experts left out; held: the default here)
                lab.rollout()  # (warm: the first fused rollout permutes the routed experts' codes)
                seconds, counted = [], []
                for _ in range(rounds):
                    start = time.perf_counter()
                    rollout = lab.rollout()
                    seconds.append(time.perf_counter() - start)
                    counted.append(rollout.experts_dequantized)
                steps = [lab.step() for _ in range(3)]
        finally:
            lab.close()
        record = {"tiny_rollout": path, "seconds": statistics.median(seconds), "experts_dequantized": counted,
                  "tokens": int(rollout.completion_mask.sum()),
                  "logprob_mismatch": [s.metrics()["logprob_mismatch"] for s in steps]}  # fmt: skip
        print(f"tiny-moe rollout, {path}: {record['seconds']:.3f} s, {counted[0]} experts dequantized, "
              f"{record['tokens']} completion tokens; learner-sampler |log-prob gap| over 3 steps "
              f"{', '.join(f'{m:.1e}' for m in record['logprob_mismatch'])}")  # fmt: skip
        print("JSON " + json.dumps(record))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[8], help="tokens in the step (one a sequence)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tiny-rollout", action="store_true", help="also builtin:tiny-moe's rollout both ways")
    args = parser.parse_args(argv)
    print(f"bfloat16, median of {args.rounds}; fused kernel: {gemv_kernel()}")
    if args.rows:
        experts, config = one_layer()
        per_expert = 3 * config.hidden_size * config.moe_intermediate_size * 2  # bytes of one expert in bfloat16
        for rows in args.rows:
            report(one_batch(experts, config, rows, args.rounds), per_expert)
    if args.tiny_rollout:
        tiny_rollout(args.rounds)


if __name__ == "__main__":
    main()
