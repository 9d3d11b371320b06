"""generator.park_learner: while the merged rollout copy decodes, the learner's state the copy never reads waits in host
memory, so the copy and its KV cache have the card (issue 50: at Qwen3-8B's shape on 24 GiB the copy, its cache and the
learner's 5.66 GiB base do not fit together).

Parked: every 4-bit base weight's codes and its quant state (absmax, the nested absmax and codebooks), the LoRA weights
and AdamW's state. Not parked: what the copy shares with the learner (embeddings, norms, an unquantized head, rotary
buffers). Each tensor is copied to host memory (pinned, from a GPU) and then emptied in place (`set_()`), so every
tensor object and every reference to it stay (the optimizer's, PEFT's, bitsandbytes' quant state); unparking puts its
values back, bit for bit, also when the rollout raises (an out-of-memory error, Ctrl-C). Why not resize the storage
to 0 bytes: a storage once shared with NumPy (`.numpy()`, as a user inspecting a weight does) can no longer be
resized."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def quant_state_tensors(state) -> list[torch.Tensor]:
    """The tensors of a bitsandbytes QuantState: absmax, code, offset, and its nested state's (double quantization)."""
    out = [t for t in (state.absmax, state.code, getattr(state, "offset", None)) if torch.is_tensor(t)]
    nested = getattr(state, "state2", None)
    return out + (quant_state_tensors(nested) if nested is not None else [])


def parked_tensors(model, optimizer) -> list[torch.Tensor]:
    """The learner's tensors the rollout copy never reads, the objects themselves: 4-bit base weights with their quant
    states' tensors, LoRA weights, AdamW's state; one per storage."""
    found: list[torch.Tensor] = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is not None:
            found += [weight, *quant_state_tensors(state)]
    found += [p for name, p in model.named_parameters() if "lora_" in name]
    for state in optimizer.state.values():
        found += [t for t in state.values() if torch.is_tensor(t)]
    unique: dict[int, torch.Tensor] = {}
    for t in found:
        if t.untyped_storage().nbytes():
            unique.setdefault(t.untyped_storage().data_ptr(), t)
    return list(unique.values())


def parked_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@contextmanager
def parked(tensors: list[torch.Tensor]) -> Iterator[int]:
    """Hold `tensors`' values in host memory (pinned when they live on a GPU) for the block, their own storage given
    back; yields the bytes parked."""
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():  # why: set_ on a parameter that requires grad
            for t in tensors:
                pin = t.device.type == "cuda"  # why pinned: the copy back runs at the link's full speed
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                host.copy_(t)
                held.append((t, host))
                t.set_()  # an empty storage of this dtype and device: the old one is freed
        yield sum(host.untyped_storage().nbytes() for _, host in held)
    finally:
        with torch.no_grad():
            for t, host in held:
                t.set_(host.to(t.device, copy=True))
