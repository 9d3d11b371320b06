"""generator.hf_decode: merged. The rollout samples from a copy of the learner in which every 4-bit + LoRA linear is one
dense weight in the compute dtype, dequantized from the nf4 base with the LoRA merged in (W + scaling * B @ A): no 4-bit
dequantization and no LoRA wrapper runs per decoded token. Every other tensor (embeddings, norms, an untouched head,
rotary buffers) is the learner's own, shared, not copied.

One copy per Lab (`RolloutCopy`): its module is built at the first merged rollout and kept, so torch.compile and CUDA
graphs meet the same module at every rollout (a new module each rollout recompiled: 31.5 and 37.6 s for rollouts 1
and 2 on an H200). Each rollout refreshes the dense weights from the current LoRA, bit for bit a fresh merge. Between
rollouts (generator.rollout_copy) they are kept, the next refresh written into the same storage, so CUDA graphs
recorded on their addresses replay; or released (0 bytes) where the plan cannot hold them beside the learner's phases
(planner/learner_items.add_rollout_copy), each rollout then giving them new storage (a recording per rollout).
Nothing of the learner is written: its 4-bit codes, quant state and LoRA stay bit for bit."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from ..errors import LabError


def dense_weight(layer, dtype: torch.dtype) -> torch.Tensor:
    """One linear layer's weight as the copy holds it: `merged_float`, cast once to `dtype`."""
    return merged_float(layer).to(dtype)


def merged_float(layer) -> torch.Tensor:
    """One linear layer's merged weight in float32: the base dequantized (4-bit) or read (16-bit), plus each active
    LoRA adapter's delta. Why float32 first: the delta is added before the one rounding, as an unmerged forward adds
    the two outputs. Why a temporary, freed once the layer is written: planner/learner_items.merge_temporary_bytes."""
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
    return dense


def merged_copy(model, dtype: torch.dtype) -> torch.nn.Module:
    """The rollout copy of `model` (a PeftModel, or a plain causal LM): the base architecture built on the meta device,
    each linear layer given `dense_weight`, every other parameter and buffer shared with `model`."""
    return build_copy(model, dtype)[0]


def build_copy(model, dtype: torch.dtype) -> tuple[torch.nn.Module, list[tuple[torch.nn.Module, torch.nn.Module]]]:
    """`merged_copy`, with its merged layers: (copy's linear, the learner's layer it merges) pairs."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with torch.device("meta"):
        copy = type(base)(base.config)
    copy.generation_config = base.generation_config
    merged = []
    for path, module in copy.named_modules():
        source = base.get_submodule(path) if path else base
        if isinstance(module, torch.nn.Linear) and (hasattr(source, "base_layer") or _quantized(source)):
            module.weight = torch.nn.Parameter(dense_weight(source, dtype), requires_grad=False)
            bias = getattr(getattr(source, "base_layer", source), "bias", None)
            module.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
            merged.append((module, source))
            continue
        for name, _ in list(module.named_parameters(recurse=False)):
            module._parameters[name] = source._parameters[name]  # the learner's own tensor, shared
        for name, _ in list(module.named_buffers(recurse=False)):
            module._buffers[name] = source._buffers[name]
    left = [n for n, t in [*copy.named_parameters(), *copy.named_buffers()] if t.is_meta]
    if left:
        raise LabError(f"generator.hf_decode: merged could not copy {left[:3]} from the learner; use dynamic")
    return copy.eval().requires_grad_(False), merged


def _quantized(module) -> bool:
    return getattr(getattr(module, "weight", None), "quant_state", None) is not None


class RolloutCopy:
    """A Lab's one rollout copy (generator.hf_decode: merged): built at the first merged rollout, refreshed at each
    later one; between rollouts kept (generator.rollout_copy: keep, each refresh written into its storage, so its
    weights keep their addresses) or released (its weights given back). A learner model other than the one it was built
    from (a reload) gets a new copy."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.module: Optional[torch.nn.Module] = None
        self.source = None  # the learner model the copy was built from
        self.merged: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        self.builds = 0  # modules built: 1 per Lab, whatever the number of rollouts

    @contextmanager
    def model_for(self, model, decode: str, keep: bool = False) -> Iterator[torch.nn.Module]:
        """The model a rollout decodes with: the learner's own, or for `merged` the copy, holding the current merge;
        released when the rollout ends (also when it raises) unless `keep`."""
        if decode != "merged":
            self.release()  # why: a copy kept by an earlier merged rollout is on no plan line of this path
            yield model
            return
        with torch.no_grad():
            if self.module is None or self.source is not model:
                self.module, self.merged, self.source = *build_copy(model, self.dtype), model
                self.builds += 1
            else:
                self.refresh()
        try:
            yield self.module
        finally:
            if not keep:
                self.release()

    def refresh(self) -> None:
        """Each merged weight re-made from the learner's current base and LoRA, bit for bit a fresh merge, on the
        copy's own parameters (the same tensor objects, so a compiled decode step is reused). A kept weight is written
        into its storage (copy_, the one rounding to the compute dtype on the way), so its address stays and a CUDA
        graph recorded on it replays; a released one (0 bytes) is given the fresh merge as its storage (set_: one
        weight-sized tensor less than a copy into new storage)."""
        for target, source in self.merged:
            if target.weight.untyped_storage().nbytes():
                target.weight.copy_(merged_float(source))
            else:
                target.weight.set_(dense_weight(source, self.dtype))

    def release(self) -> None:
        """The dense weights given back, each parameter emptied in place (`set_()`; the module stays): why: the
        learner's phases never hold a released copy, as the plan promises. Why not resize the storage to 0 bytes: one
        a user shared with NumPy (`.numpy()`) can no longer be resized (models/park.py)."""
        with torch.no_grad():
            for target, _ in self.merged:
                target.weight.set_()

    def held_bytes(self) -> int:
        """Bytes the copy's own weights hold now (0 between rollouts when released)."""
        return sum(target.weight.untyped_storage().nbytes() for target, _ in self.merged)

    def addresses(self) -> list[int]:
        """Where each merged weight's storage is now (the same from rollout 2 on when kept)."""
        return [target.weight.data_ptr() for target, _ in self.merged]
