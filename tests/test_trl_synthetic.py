"""bench/gpu/trl_synthetic.py on the CPU: TRL's real GRPOTrainer takes one step on fixed-length synthetic rollouts."""

from __future__ import annotations

import torch

P, L, G = 8, 12, 2


def _lora_b(model) -> dict[str, torch.Tensor]:
    """A copy of every LoRA B matrix in `model` (the PeftModel or the base model it wraps), by base-model name."""
    return {
        name.removeprefix("base_model.model."): p.detach().clone()
        for name, p in model.named_parameters()
        if "lora_B" in name
    }


def test_one_trl_step_on_synthetic_rollouts(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from bench.gpu.trl_synthetic import trl_step_peak

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    before = {}

    class Snapshot(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            before.update(_lora_b(model))

    result = trl_step_peak(
        model,
        tokenizer,
        prompt_tokens=P,
        completion_tokens=L,
        num_generations=G,
        lora_r=8,
        lora_alpha=16,
        bf16=False,
        device="cpu",
        out_dir=str(tmp_path),
        callbacks=[Snapshot()],
    )

    assert "oom" not in result
    assert result["completion_length"] == L  # TRL's own completions/mean_length: nothing truncated at an EOS
    assert result["num_tokens"] == G * (P + L)  # and every prompt was P tokens
    assert result["peak"] > 0 and result["seconds"] > 0
    after = _lora_b(model)  # TRL injected the adapter into the model it was given
    assert before and before.keys() == after.keys()
    assert all(torch.count_nonzero(b) == 0 for b in before.values())  # LoRA B starts at zero
    assert all(torch.count_nonzero(a) > 0 for a in after.values()), "a LoRA B matrix did not move in the step"


def test_content_ids_are_fixed_and_never_special(tiny_model):
    from transformers import AutoTokenizer

    from grpo_lab.generation.synthetic import content_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    vocab = len(tokenizer)
    ids = content_ids(tokenizer, 5, 300, first_row=3, vocab_size=vocab)

    assert ids == content_ids(tokenizer, 5, 300, first_row=3, vocab_size=vocab)
    assert len(ids) == 5 and all(len(row) == 300 for row in ids)
    assert len({tuple(row) for row in ids}) == 5  # the sequences differ
    banned = {tokenizer.eos_token_id, tokenizer.pad_token_id, *tokenizer.all_special_ids}
    banned |= set(tokenizer.added_tokens_decoder)
    banned.discard(None)
    seen = {t for row in ids for t in row}
    assert not seen & banned
    assert all(0 <= t < vocab for t in seen)
    # an id excluded by the caller (TRL adds the model's generation_config EOS ids) is avoided too
    avoiding_5 = content_ids(tokenizer, 5, 300, first_row=3, exclude=[5], vocab_size=vocab)
    assert 5 in seen and 5 not in {t for row in avoiding_5 for t in row}


def test_content_ids_stay_below_the_tokenizer(tiny_model):
    """A model's embedding may be padded past the tokenizer (e.g. Qwen): ids stay decodable."""
    from transformers import AutoTokenizer

    from grpo_lab.generation.synthetic import content_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert max(t for row in content_ids(tokenizer, 3, 500, vocab_size=10_000) for t in row) < len(tokenizer)


def test_cuda_oom_is_returned_not_raised(tiny_model, tmp_path, monkeypatch):
    """An out-of-memory in TRL's step comes back as {"oom": its first line} (the frontier's "does not fit")."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from bench.gpu.trl_synthetic import trl_step_peak

    def out_of_memory(self, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(GRPOTrainer, "train", out_of_memory)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    result = trl_step_peak(
        model,
        AutoTokenizer.from_pretrained(tiny_model),
        prompt_tokens=P,
        completion_tokens=L,
        num_generations=G,
        lora_r=8,
        lora_alpha=16,
        bf16=False,
        device="cpu",
        out_dir=str(tmp_path),
    )
    assert result == {"oom": "CUDA out of memory. Tried to allocate 2.00 GiB"}
