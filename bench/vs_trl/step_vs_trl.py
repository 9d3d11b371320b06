"""Step time: grpo_lab vs TRL's GRPOTrainer, alternated step by step in one process.

Both use the same tiny 4-bit checkpoint, LoRA, num_generations, lengths, temperature, beta and
loss, the HF generator, on the CPU. TRL's micro-batching is set to match grpo_lab's
(`per_device_train_batch_size` = micro_batch_size, gradient accumulation over the step batch).
A TrainerCallback times each TRL optimizer step and, right after it, runs and times one grpo_lab
step, so both see the same machine state. Prints a markdown row for docs/benchmarks.md.

    .venv/bin/python bench/vs_trl/step_vs_trl.py --steps 12 --warmup 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings


def trl_trainer(cfg, callback, steps, out_dir, device: str = "cpu", model=None, peft_config=None):
    """TRL 1.16's GRPOTrainer on `cfg`'s run: `model` (default: the lab's load of cfg.model) wrapped by TRL with
    `peft_config` (default: LoRA on cfg.lora.target_modules)."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from grpo_lab.algo.rewards import resolve_reward
    from grpo_lab.data.arithmetic import arithmetic_rows
    from grpo_lab.data.formats import reward_prompt
    from grpo_lab.models.learner import load_base, load_tokenizer

    g, grpo = cfg.generator, cfg.grpo
    batch = grpo.prompts_per_step * grpo.num_generations
    micro = grpo.micro_batch_size or batch
    rows = arithmetic_rows(cfg.data.num_prompts, cfg.run.seed)
    dataset = Dataset.from_list(
        [{"prompt": reward_prompt(r["prompt"], cfg.data.system_prompt), "answer": r["answer"]} for r in rows]
    )
    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=device == "cpu",
        report_to=[],
        save_strategy="no",
        logging_steps=10_000,
        bf16=cfg.model.bnb_4bit_compute_dtype == "bfloat16",
        max_steps=steps,
        seed=cfg.run.seed,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        steps_per_generation=batch // micro,
        num_generations=grpo.num_generations,
        max_completion_length=g.max_completion_length,
        temperature=g.temperature,
        top_p=g.top_p,
        beta=grpo.beta,
        loss_type=grpo.loss_type,
        scale_rewards=grpo.scale_rewards,
        epsilon=grpo.epsilon,
        learning_rate=grpo.learning_rate,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        max_grad_norm=grpo.max_grad_norm,
        lr_scheduler_type="constant",
        warmup_steps=0,
        disable_tqdm=True,
    )
    lora = cfg.lora
    peft_config = peft_config or LoraConfig(
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    return GRPOTrainer(
        model=load_base(cfg.model, device) if model is None else model,
        args=args,
        train_dataset=dataset,
        processing_class=load_tokenizer(cfg.model.name_or_path),
        reward_funcs=[resolve_reward(r) for r in cfg.data.rewards],
        callbacks=[callback],
        peft_config=peft_config,
    )


def main() -> None:
    import tempfile

    from transformers import TrainerCallback

    from grpo_lab import Lab, load_config
    from grpo_lab.models.tiny import ensure_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny-cpu")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="leading steps of each left out of the medians")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--json", help="also write the raw timings here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    cfg = load_config(args.config, args.set)
    ensure_tiny_model(cfg.model.name_or_path)
    lab = Lab(cfg).load()
    timings = {"trl": [], "grpo_lab": [], "trl_len": [], "grpo_lab_len": []}

    class Alternate(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            timings["trl"].append(time.perf_counter() - self.t0)
            t0 = time.perf_counter()
            result = lab.step()
            timings["grpo_lab"].append(time.perf_counter() - t0)
            timings["grpo_lab_len"].append(result.completion_length_mean)

        def on_log(self, args_, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                timings["trl_len"].append(logs["completions/mean_length"])

    with tempfile.TemporaryDirectory() as tmp:
        trainer = trl_trainer(cfg, Alternate(), args.steps, tmp)
        trainer.args.logging_steps = 1
        trainer.train()

    kept = {k: v[args.warmup :] for k, v in timings.items() if k in ("trl", "grpo_lab")}
    ratios = [a / b for a, b in zip(kept["grpo_lab"], kept["trl"])]
    med = {k: statistics.median(v) for k, v in kept.items()}
    mean_len = {k: statistics.mean(timings[f"{k}_len"]) if timings[f"{k}_len"] else float("nan") for k in kept}
    print(
        f"| {args.config} | {len(ratios)} | {med['grpo_lab']:.3f} | {med['trl']:.3f} | "
        f"{statistics.median(ratios):.2f} | {mean_len['grpo_lab']:.1f} / {mean_len['trl']:.1f} |"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(timings, f, indent=1)


if __name__ == "__main__":
    main()
