"""generator.park_learner: while the merged rollout copy decodes, the learner's state the copy never reads waits in host
memory, so the copy and its KV cache have the card (at Qwen3-8B's shape on 24 GiB the copy, its cache and the
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


class Parking:
    """A Lab's parked learner state: each tensor's host copy is held here until that tensor is back on its device.
    Why held here, not in a context's locals: an out-of-memory error (or Ctrl-C) while putting the learner back
    left the rest of its tensors empty and dropped their only copies, and the next step crashed the process; now
    `put_back` goes on from the tensor it stopped at, at the Lab's next command (execution/local.py)."""

    def __init__(self):
        self.held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the learner's tensor, its values on the host)
        self.back = 0  # how many of `held` are on their device again (a put_back that raised goes on from here)

    @property
    def pending(self) -> int:
        """Tensors still waiting in host memory."""
        return len(self.held) - self.back

    def pending_bytes(self) -> int:
        return sum(host.untyped_storage().nbytes() for _, host in self.held[self.back :])

    def park(self, tensors: list[torch.Tensor]) -> int:
        """Copy each tensor to host memory (pinned when it lives on a GPU), then give its storage back; the bytes
        parked. A tensor is emptied only once its copy is held, so an error at any tensor loses nothing."""
        self.put_back()  # (what an earlier rollout could not put back: before anything is parked again)
        with torch.no_grad():  # why: set_ on a parameter that requires grad
            for t in tensors:
                self.held.append((t, self.to_host(t)))
                t.set_()  # an empty storage of this dtype and device: the old one is freed
        return self.pending_bytes()

    @staticmethod
    def to_host(t: torch.Tensor) -> torch.Tensor:
        pin = t.device.type == "cuda"  # why pinned: the copy back runs at the link's full speed
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        return host.copy_(t)

    @staticmethod
    def to_device(t: torch.Tensor, host: torch.Tensor) -> None:
        t.set_(host.to(t.device, copy=True))

    def put_back(self) -> None:
        """Every held tensor's values back on its device, in order; a tensor's host copy is let go only once it is
        back. Raises as its copy raises (out of memory): the rest stay held, and a later call goes on."""
        with torch.no_grad():
            while self.back < len(self.held):
                self.to_device(*self.held[self.back])  # (a retry after Ctrl-C here sets the same values again)
                self.back += 1
        self.held, self.back = [], 0  # why: every tensor is back; the host copies go


@contextmanager
def parked(tensors: list[torch.Tensor], parking: "Parking | None" = None) -> Iterator[int]:
    """Hold `tensors`' values in host memory for the block, their own storage given back; yields the bytes parked.
    Put back as the block ends, also when it raises; if putting back raises, `parking` still holds what is not back."""
    parking = Parking() if parking is None else parking
    try:
        yield parking.park(tensors)
    finally:
        parking.put_back()
