"""TRL's side of the memory frontier, learner only: one real TRL 1.16 GRPOTrainer optimizer step on synthetic rollouts.

Generation is the one thing replaced: every prompt is the same fixed P tokens and every completion exactly L fixed
tokens (grpo_lab's `content_ids`, the ids its synthetic backend gives: never an EOS/pad/special id, so nothing ends
early). The subclass overrides only the two
narrowest hooks that return token ids, `_tokenize_prompts` (prompt ids) and `_generate_single_turn` (completion ids);
TRL's own `_generate` (lengths metrics, decoding), `_generate_and_score_completions` (padding, masks, rewards,
advantages, old/ref log-probs), `_compute_loss`, backward, clipping and the optimizer all run unchanged. The model is
handed to TRL as built (e.g. a frozen bitsandbytes nf4 base): TRL 1.16 wraps it with `get_peft_model` and, for a
quantized base, casts the trainable LoRA weights to bf16 (grpo_trainer.py, "When using QLoRA ..."); it does not call
`prepare_model_for_kbit_training`. Both are kept as TRL does them.

    .venv/bin/python -m bench.gpu.trl_synthetic          # CPU dry run on builtin:tiny-random (P=8, L=12, G=2)

(GRPO_LAB_CACHE names the cache the tiny model is built into, once.)
"""

from __future__ import annotations

import gc
import resource
import tempfile
import time
from typing import Any

import torch

from grpo_lab.generation.synthetic import content_ids

# Offset of the prompt's content, so the prompt never equals completion k.
_PROMPT_OFFSET = 10_007


def index_reward(completions: list, **_: Any) -> list[float]:
    """A trivial reward that differs within every group (completion index), so TRL's advantages are non-zero."""
    return [float(i) for i in range(len(completions))]


def synthetic_trainer_class():
    """GRPOTrainer with generation replaced by fixed synthetic ids (imported lazily: TRL is slow to import)."""
    from trl import GRPOTrainer

    class SyntheticGRPOTrainer(GRPOTrainer):
        """TRL's GRPOTrainer whose prompts are `prompt_tokens` fixed ids and whose completions are exactly
        `completion_tokens` fixed ids; set both attributes before `train()`."""

        prompt_tokens: int
        completion_tokens: int

        def _ids(self, n: int, length: int, offset: int) -> list[list[int]]:
            model = self.accelerator.unwrap_model(self.model)
            vocab = model.get_input_embeddings().num_embeddings
            return content_ids(self._tokenizer, n, length, offset, exclude=self.eos_token_ids, vocab_size=vocab)

        def _tokenize_prompts(self, prompts: list):
            """One fixed prompt of exactly `prompt_tokens` ids per input prompt; no images, no multimodal fields."""
            prompt = self._ids(1, self.prompt_tokens, _PROMPT_OFFSET)[0]
            return [list(prompt) for _ in prompts], None, {}

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            """Completion k is synthetic sequence k, `completion_tokens` long; no sampling log-probs (as TRL's own
            transformers path returns), so TRL computes every log-prob itself."""
            return self._ids(len(prompt_ids), self.completion_tokens, 0), None

    return SyntheticGRPOTrainer


def _peak_bytes(device: str) -> int:
    """torch.cuda.max_memory_allocated on cuda; else the process's peak RSS (ru_maxrss, KiB on Linux) in bytes."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _logged(history: list[dict], key: str) -> float | None:
    """The last value of `key` TRL logged (trainer.state.log_history), or None."""
    values = [row[key] for row in history if key in row]
    return values[-1] if values else None


def build_trainer(
    model,
    tokenizer,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    num_generations: int,
    lora_r: int,
    lora_alpha: int,
    loss_type: str,
    bf16: bool,
    device: str,
    out_dir: str,
    callbacks: list | None = None,
):
    """The synthetic GRPOTrainer for one optimizer step: micro-batch 1, G micro-steps of gradient accumulation fed by
    one generation call (steps_per_generation=G, one group), beta 0, gradient checkpointing, LoRA on all linears."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig

    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=device == "cpu",
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        bf16=bf16,
        max_steps=1,
        seed=0,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=num_generations,
        steps_per_generation=num_generations,
        num_generations=num_generations,
        max_completion_length=completion_tokens,  # TRL 1.16's GRPOConfig has no max_prompt_length
        beta=0.0,
        loss_type=loss_type,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        gradient_checkpointing=True,
    )
    trainer = synthetic_trainer_class()(
        model=model,
        args=args,
        # the text is a placeholder: _tokenize_prompts replaces it with the fixed synthetic prompt
        train_dataset=Dataset.from_list([{"prompt": "synthetic"}] * 4),
        processing_class=tokenizer,
        reward_funcs=[index_reward],
        callbacks=callbacks,
        peft_config=LoraConfig(
            r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        ),
    )
    trainer.prompt_tokens, trainer.completion_tokens = prompt_tokens, completion_tokens
    return trainer


def trl_step_peak(
    model,
    tokenizer,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    num_generations: int,
    lora_r: int,
    lora_alpha: int,
    loss_type: str = "grpo",
    bf16: bool,
    device: str,
    out_dir: str,
    callbacks: list | None = None,
) -> dict:
    """One TRL GRPO optimizer step on synthetic rollouts (see the module docstring). Returns
    {"peak": bytes (CUDA max allocated since just before train(); on the CPU the process's peak RSS, imports
    included), "seconds": train() wall time, "completion_length": TRL's logged completions/mean_length (asserted
    == completion_tokens), "loss": TRL's logged loss, "num_tokens": TRL's logged token count, G * (P + L) here};
    a CUDA out-of-memory returns {"oom": its first line} instead. `model` is mutated: TRL injects the LoRA layers
    into it. `callbacks` go to the trainer (e.g. to look at the LoRA weights at on_train_begin)."""
    cuda = device.startswith("cuda")
    trainer = None
    oom = None
    try:
        trainer = build_trainer(
            model,
            tokenizer,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            num_generations=num_generations,
            lora_r=lora_r,
            lora_alpha=lora_alpha,
            loss_type=loss_type,
            bf16=bf16,
            device=device,
            out_dir=out_dir,
            callbacks=callbacks,
        )
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        trainer.train()
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        peak = _peak_bytes(device)
    except torch.cuda.OutOfMemoryError as e:
        oom = (str(e).strip().splitlines() or ["CUDA out of memory"])[0]
    if oom is not None:  # outside the except block, so the traceback's frames (and their tensors) are gone
        del trainer
        for param in model.parameters():  # the LoRA grads TRL left on the caller's model
            param.grad = None
        gc.collect()
        torch.cuda.empty_cache()
        return {"oom": oom}
    history = trainer.state.log_history
    length = _logged(history, "completions/mean_length")
    assert length == completion_tokens, f"TRL logged mean completion length {length}, expected {completion_tokens}"
    return {
        "peak": peak,
        "seconds": seconds,
        "completion_length": length,
        "loss": _logged(history, "loss"),
        "num_tokens": _logged(history, "num_tokens"),
    }


def main() -> None:
    """CPU dry run on the built-in tiny random model (float32, no 4-bit): P=8, L=12, G=2, r=8."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_lab.models.source import resolve_model_path

    path = resolve_model_path("builtin:tiny-random")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with tempfile.TemporaryDirectory() as out:
        result = trl_step_peak(
            model,
            tokenizer,
            prompt_tokens=8,
            completion_tokens=12,
            num_generations=2,
            lora_r=8,
            lora_alpha=16,
            bf16=False,
            device="cpu",
            out_dir=out,
        )
    print(result)


if __name__ == "__main__":
    main()
