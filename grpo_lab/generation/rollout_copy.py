"""generator.hf_decode: merged. The rollout samples from a copy of the learner in which every 4-bit + LoRA linear is one
dense weight in the compute dtype, dequantized from the nf4 base with the LoRA merged in (W + scaling * B @ A): no 4-bit
dequantization and no LoRA wrapper runs per decoded token. Every other tensor (embeddings, norms, an untouched head,
rotary buffers) is the learner's own, shared, not copied. The copy is built at the rollout from the current LoRA
weights and dropped when it ends, so the learner's phases never hold it (planner/learner_items.rollout_copy_bytes).
Nothing of the learner is written: its 4-bit codes, quant state and LoRA stay bit for bit."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from ..errors import LabError


def dense_weight(layer, dtype: torch.dtype) -> torch.Tensor:
    """One linear layer's weight as the copy holds it: the base dequantized (4-bit) or read (16-bit) in float32, plus
    each active LoRA adapter's delta, then cast once to `dtype`. Why float32 first: the delta is added before the one
    rounding, as an unmerged forward adds the two outputs."""
    base_layer = getattr(layer, "base_layer", layer)
    weight = base_layer.weight
    state = getattr(weight, "quant_state", None)
    if state is not None:
        import bitsandbytes.functional as bnbf

        dense = bnbf.dequantize_4bit(weight.data, state).float()
    else:
        dense = weight.detach().float().clone()
    for adapter in getattr(layer, "active_adapters", []) if base_layer is not layer else []:
        if adapter not in layer.lora_A:
            continue
        if getattr(layer, "use_dora", {}).get(adapter):
            raise LabError(
                "generator.hf_decode: merged merges LoRA adapters, and this one is DoRA; use dynamic (or compiled)"
            )
        if getattr(layer, "fan_in_fan_out", False):
            dense += layer.get_delta_weight(adapter).float()
        else:  # why in place: B @ A added into the dense weight, no second weight-sized tensor (PEFT's delta makes one)
            a, b = layer.lora_A[adapter].weight.float(), layer.lora_B[adapter].weight.float()
            dense.addmm_(b, a, alpha=layer.scaling[adapter])
    return dense.to(dtype)


def merged_copy(model, dtype: torch.dtype) -> torch.nn.Module:
    """The rollout copy of `model` (a PeftModel, or a plain causal LM): the base architecture built on the meta device,
    each linear layer given `dense_weight`, every other parameter and buffer shared with `model`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with torch.device("meta"):
        copy = type(base)(base.config)
    copy.generation_config = base.generation_config
    for path, module in copy.named_modules():
        source = base.get_submodule(path) if path else base
        if isinstance(module, torch.nn.Linear) and (hasattr(source, "base_layer") or _quantized(source)):
            module.weight = torch.nn.Parameter(dense_weight(source, dtype), requires_grad=False)
            bias = getattr(getattr(source, "base_layer", source), "bias", None)
            module.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
            continue
        for name, _ in list(module.named_parameters(recurse=False)):
            module._parameters[name] = source._parameters[name]  # the learner's own tensor, shared
        for name, _ in list(module.named_buffers(recurse=False)):
            module._buffers[name] = source._buffers[name]
    left = [n for n, t in [*copy.named_parameters(), *copy.named_buffers()] if t.is_meta]
    if left:
        raise LabError(f"generator.hf_decode: merged could not copy {left[:3]} from the learner; use dynamic")
    return copy.eval().requires_grad_(False)


def _quantized(module) -> bool:
    return getattr(getattr(module, "weight", None), "quant_state", None) is not None


@contextmanager
def rollout_model(model, decode: str, dtype: torch.dtype) -> Iterator[torch.nn.Module]:
    """The model a rollout decodes with: the learner's own, or for `merged` its rollout copy, dropped on exit (also
    when the rollout raises). Why dropped, not kept: the learner's phases then run without it (the plan's promise)."""
    if decode != "merged":
        yield model
        return
    with torch.no_grad():
        copy = merged_copy(model, dtype)
    try:
        yield copy
    finally:
        del copy
