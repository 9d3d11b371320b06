"""How many aten ops a decoding step runs, counted on the CPU with torch.profiler, for the device check's time budget
(bench/gpu/fast_path_and_moe.sh): HF decoding on a GPU is launch-bound, so a step's time there goes about as its op
count. Qwen2.5-0.5B's shape (24 layers, its H100 time per step is recorded) against one and two layers of
Qwen3-30B-A3B's (a layer's ops: their difference) with LoRA on the experts, as the check runs it; the routed experts are
dequantized as on a GPU (bitsandbytes' fused CPU kernel and the held experts left out).

    OMP_NUM_THREADS=1 python -m bench.probes.decode_ops
"""

from __future__ import annotations

import json


def ops_a_step(name: str, extra: list[str], tokens: int = 4) -> float:
    """Aten ops a decoding step of `name`'s learner (nf4 + LoRA, 8 rows, sampled as a rollout samples: the routed
    path's ops grow with the experts a step reaches, and greedy decoding of random weights reaches fewer): generate()
    of 2 x `tokens` tokens less one of `tokens`, over `tokens` (the prefill and setup cancel out)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu.gpu_check import base_overrides
    from grpo_lab import load_config
    from grpo_lab.models.learner import add_lora, load_base

    cfg = load_config("tiny-cpu", base_overrides(name, "cpu", 8) + extra)
    model = add_lora(load_base(cfg.model, "cpu"), cfg).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]] * 8)
    counts = {}
    for new in (tokens, 2 * tokens):
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            mask = torch.ones_like(ids)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=True)
        counts[new] = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    return (counts[2 * tokens] - counts[tokens]) / tokens


def main() -> None:
    import grpo_lab.models.routed_experts as routed
    from bench.gpu.trl_side import EXPERTS

    for path in ("gemv", "held"):  # why: a GPU dequantizes the routed experts (routed_experts.EXPERT_PATHS)
        routed.EXPERT_PATHS.pop(path)
    small = ops_a_step("builtin:qwen2.5-0.5b-random", [])
    moe = "builtin:qwen3-30b-a3b-random:layers={}"
    one, two = ops_a_step(moe.format(1), list(EXPERTS)), ops_a_step(moe.format(2), list(EXPERTS))
    step = one + 47 * (two - one)  # 48 layers
    print(json.dumps({"qwen2.5-0.5b (24 layers)": small, "qwen3-30b-a3b with expert LoRA, a layer": two - one,
                      "48 layers": step, "ratio to 0.5b": round(step / small, 2)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
