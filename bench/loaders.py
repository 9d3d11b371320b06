"""The 4-bit + LoRA learner of the FSDP2 probes (bench/probes/fsdp2_probe.py, bench/probes/fsdp2_qlora_probe.py),
loaded once here: the base as grpo_lab's learner.load_base builds it, with `bnb_4bit_quant_storage` set, and LoRA on
all linear layers."""

from __future__ import annotations


def load_4bit_base(model: str, storage: str):
    """The built-in `model` (`builtin:<model>`) in nf4 (double quant, float32 compute), its 4-bit weights stored as
    `storage` (a torch dtype's name: uint8, bfloat16, float32), on the CPU, its training layout pinned, frozen."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from grpo_lab.models.quant import pin_training_layout
    from grpo_lab.models.source import resolve_model_path

    path = resolve_model_path(f"builtin:{model}")  # ensure_tiny_model(builtin_path(model)) with the model's shape
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=getattr(torch, storage),
    )
    base = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, device_map={"": "cpu"}, quantization_config=quant
    )
    # why: as every grpo_lab learner; unpinned, bnb's AVX-512-BF16 repack on no-grad forwards happens (docs/fsdp2.md)
    pin_training_layout(base)
    base.requires_grad_(False)
    base.config.use_cache = False
    return base


def with_lora(base, seed: int = 0, init_lora_weights: bool = True):
    """`base` with LoRA r 8 (alpha 16) on all linear layers, drawn after torch.manual_seed(seed) (the same LoRA init
    in every process). init_lora_weights=False: B random too (peft's default leaves B = 0)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(
        base,
        LoraConfig(
            r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM", init_lora_weights=init_lora_weights
        ),
    )
