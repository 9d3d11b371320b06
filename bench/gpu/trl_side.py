"""TRL 1.16's side of the GPU check (bench/gpu/gpu_check.py's `trl` and `trl_experts` workers): its GRPOTrainer on the
check's config, timed step by step, its generation timed apart (TRL logs no generation time of its own), what it trains
read from its model, and a CUDA out-of-memory recorded with the stage it came in.

Issue 70's part of the device check (bench/gpu/fast_path_and_moe.sh): Qwen3-30B-A3B's GRPO step with LoRA on its
experts, grpo_lab beside TRL 1.16 on the same capped card, each side's model and adapters as that tool makes them.

- grpo_lab (`lora.target_experts: true`): the experts in nf4 (bitsandbytes' parametrization), drawn and quantized a
  layer at a time; PEFT's `target_parameters` adapters on them, folded into the routed experts alone.
- TRL (`trl_experts`, gpu_check's worker): the model TRL trains from `from_pretrained(..., quantization_config=nf4)`:
  transformers' bitsandbytes quantizer replaces nn.Linear only, so attention is nf4 and the fused experts stay in
  bfloat16 (here drawn so, `build_random(experts_4bit=False)`); TRL 1.16's GRPOTrainer wraps it with `get_peft_model`
  and the LoraConfig below. Why not `target_modules="all-linear"` alone: PEFT 0.21 maps it on a Qwen3-MoE
  (transformers 5's fused experts, peft/utils/transformers_weight_conversion.py) to the routers' weights and the experts
  as `target_parameters`, at rank r on down_proj and 2r on gate_up_proj; the LoraConfig here names the attention's
  nn.Linear modules and the experts alone, at the same rank as grpo_lab's (`expert_lora_kwargs`), so both sides train
  the same adapters.

Each side's record says what it trained (`adapter_facts`): the expert adapters PEFT made (ParamWrapper modules), their
ranks and parameters, and the experts' stored dtype, so a record shows that TRL's side really targeted the experts.

    python -m bench.gpu.trl_side --model builtin:tiny-moe   # both sides' models on the CPU, untrained: what each trains
"""

from __future__ import annotations

import time

# The expert adapters' rank (lora.expert_r): PEFT 0.21's ParamWrapper gives each of a layer's experts its own rank-r
# adapter (lora_A of r x num_experts rows), so 128 experts at rank r hold 128x one adapter's parameters. Rank 1 is
# r / num_experts (8 / 128) rounded up to the least rank: 39.3M parameters over 48 layers (the attention's at r = 8:
# 6.7M); planned backward 20.18 GiB allocated of 24 at 512 tokens, 21.78 at 1,024. At expert_r = r = 8 (each
# expert's rank under PEFT's all-linear conversion) the plan is 26.4 GiB at 1,024 tokens: over the card.
EXPERT_R = 1
EXPERTS = ("lora.target_experts=true", f"lora.expert_r={EXPERT_R}")


def trl_model(cfg):
    """cfg.model as TRL 1.16 gets it with a 4-bit BitsAndBytesConfig (its `create_model_from_path`: from_pretrained):
    nn.Linear in nf4, the fused experts in model.dtype; frozen, no KV cache in training, as the lab's load. A built-in
    random shape has no files: drawn so (`build_random(experts_4bit=False)`)."""
    from transformers import AutoModelForCausalLM

    from grpo_lab.models.learner import _DTYPES, quantization_config
    from grpo_lab.models.quant import pin_training_layout
    from grpo_lab.models.random_shapes import build_random, parse_random

    shape, device = parse_random(cfg.model.name_or_path), cfg.placement.learner
    dtype, quant = _DTYPES[cfg.model.dtype], quantization_config(cfg.model)
    if shape is not None:
        model = build_random(shape, device, 0, dtype, quant, experts_4bit=False)
    else:
        kwargs = {"dtype": dtype, "device_map": {"": device}, "quantization_config": quant}
        model = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, **kwargs)
    pin_training_layout(model)  # why: bitsandbytes' CPU repack breaks a training forward (a dry run); none on CUDA
    model.requires_grad_(False)
    model.config.use_cache = False
    return model


def trl_lora(model, lora):
    """PEFT's LoraConfig for TRL's side: the attention's nn.Linear modules at lora.r and the experts as
    `target_parameters` at lora.expert_r, the same adapters as grpo_lab's (models/learner.py, models/expert_lora.py)."""
    from peft import LoraConfig

    from grpo_lab.models.expert_lora import expert_lora_kwargs
    from grpo_lab.models.learner import moe_linear_targets

    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=0.0,  # why: PEFT's ParamWrapper refuses dropout
        target_modules=moe_linear_targets(model, lora.target_modules),
        task_type="CAUSAL_LM",
        **expert_lora_kwargs(model, lora),
    )


def trl_side(cfg):
    """(model, peft_config) of the trl_experts worker (bench/gpu/trl_side.trl_worker's `build`)."""
    model = trl_model(cfg)
    return model, trl_lora(model, cfg.lora)


def adapter_facts(model) -> dict:
    """What `model` trains, read from it: trainable parameters, the expert adapters PEFT made (ParamWrapper modules),
    their ranks and parameters, and each frozen expert tensor's stored dtype (bitsandbytes' codes are uint8)."""
    from peft.tuners.lora.layer import ParamWrapper

    wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper)]
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    stored = set()
    for name, param in model.named_parameters():
        if ".experts." in name and not param.requires_grad:
            leaf = name.split(".experts.")[-1].replace("base_layer.", "")
            stored.add(f"{leaf} {str(param.dtype).removeprefix('torch.')}")
    return {
        "trainable_params": sum(p.numel() for _, p in trainable),
        "expert_adapters": len(wrappers),
        "expert_adapter_params": sum(p.numel() for n, p in trainable if ".experts." in n),
        "expert_ranks": sorted({r for w in wrappers for r in w.r.values()}),
        "experts_stored": sorted(stored),
    }


def trl_worker(overrides: list[str], steps: int, warmup: int, build=None) -> dict:
    """TRL 1.16's GRPOTrainer on the same config: `build(cfg)` gives (model, peft_config) (None: the lab's load and
    LoRA on lora.target_modules; `trl_side` for the trl_experts side). A CUDA out-of-memory returns
    the record with `failed` and the stage it came in (load, trainer, generate, train), not a traceback."""
    import tempfile

    import torch

    from bench.gpu.gpu_check import ProcessPeak, cap_card
    from grpo_lab import load_config
    from grpo_lab.models.source import resolve_model_path

    cfg = load_config("tiny-cpu", overrides)
    cap_card(cfg)
    cfg.update({"model.name_or_path": resolve_model_path(cfg.model.name_or_path)})
    peak = ProcessPeak(cfg.placement.learner)
    seen = {"stage": "load", "seconds": [], "lengths": [], "generating": [], "facts": {}}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            trl_steps(cfg, build, steps, warmup, tmp, seen)
    except torch.cuda.OutOfMemoryError as err:
        first = (str(err).strip().splitlines() or ["CUDA out of memory"])[0]
        return {"failed": f"CUDA out of memory at TRL's {seen['stage']}: {first[:300]}", "stage": seen["stage"],
                "peak": peak.read(), **seen["facts"]}  # fmt: skip
    batch = cfg.grpo.prompts_per_step * cfg.grpo.num_generations
    pairs = zip(seen["lengths"][warmup:], seen["generating"][warmup:])
    tps = [length * batch / s for length, s in pairs if s > 0]
    return {"seconds": seen["seconds"], "peak": peak.read(), "rollout_tokens_per_s": tps,
            "completion_length": seen["lengths"][-1:], **seen["facts"]}  # fmt: skip


def trl_steps(cfg, build, steps: int, warmup: int, out_dir: str, seen: dict) -> None:
    """TRL's trainer on `build(cfg)`'s model and LoRA, trained `warmup + steps` steps; what it times, logs and trains
    goes into `seen` as it comes (its stage too, so an out-of-memory says where it came)."""
    from transformers import TrainerCallback

    from bench.vs_trl.step_vs_trl import trl_trainer

    marks = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kwargs):
            marks["t0"] = time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):
            if state.global_step > warmup:
                seen["seconds"].append(time.perf_counter() - marks["t0"])

        def on_log(self, args_, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                seen["lengths"].append(logs["completions/mean_length"])

    def timed(generate):  # why: TRL logs no generation time of its own
        def run(*args, **kwargs):
            seen["stage"], t0 = "generate", time.perf_counter()
            out = generate(*args, **kwargs)
            seen["generating"].append(time.perf_counter() - t0)
            seen["stage"] = "train (log-probs, loss, backward, optimizer)"
            return out

        return run

    model, peft_config = build(cfg) if build else (None, None)
    seen["stage"] = "trainer (get_peft_model)"
    trainer = trl_trainer(cfg, Timer(), warmup + steps, out_dir, cfg.placement.learner, model, peft_config)
    seen["facts"] = adapter_facts(trainer.model)
    trainer.args.logging_steps = 1
    trainer._generate = timed(trainer._generate)
    seen["stage"] = "train"
    trainer.train()


def trl_experts_worker(overrides: list[str], steps: int, warmup: int) -> dict:
    """TRL given a mixture of experts as it loads one, with LoRA on its experts (`trl_side`)."""
    return trl_worker(overrides, steps, warmup, build=trl_side)


def main() -> None:
    """Both sides' models of `--model` on the CPU with the check's expert LoRA, not trained: a JSON line each of what
    it would train (adapter_facts)."""
    import argparse
    import json

    from peft import get_peft_model

    from bench.gpu.gpu_check import base_overrides
    from grpo_lab import load_config
    from grpo_lab.models.learner import add_lora, load_base
    from grpo_lab.models.source import resolve_model_path

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-moe")
    args = parser.parse_args()
    cfg = load_config("tiny-cpu", base_overrides(resolve_model_path(args.model), "cpu", 8) + list(EXPERTS))
    ours = add_lora(load_base(cfg.model, "cpu"), cfg)
    print(json.dumps({"side": "grpo_lab", **adapter_facts(ours)}), flush=True)
    del ours
    model = trl_model(cfg)
    theirs = get_peft_model(model, trl_lora(model, cfg.lora))  # what TRL 1.16's GRPOTrainer does with a peft_config
    print(json.dumps({"side": "trl_experts", **adapter_facts(theirs)}), flush=True)


if __name__ == "__main__":
    main()
