"""TRL 1.16's side of the GPU check (bench/gpu/gpu_check.py's `trl` and `trl_experts` workers): its GRPOTrainer on the
check's config, timed step by step, its generation timed apart (TRL logs no generation time of its own), what it trains
read from its model, and a CUDA out-of-memory recorded with the stage it came in."""

from __future__ import annotations

import time


def trl_worker(overrides: list[str], steps: int, warmup: int, build=None) -> dict:
    """TRL 1.16's GRPOTrainer on the same config: `build(cfg)` gives (model, peft_config) (None: the lab's load and
    LoRA on lora.target_modules; bench/gpu/moe_experts.py's for the trl_experts side). A CUDA out-of-memory returns
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

    from bench.gpu.moe_experts import adapter_facts
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
    """TRL given a mixture of experts as it loads one, with LoRA on its experts (bench/gpu/moe_experts.py)."""
    from bench.gpu.moe_experts import trl_side

    return trl_worker(overrides, steps, warmup, build=trl_side)
