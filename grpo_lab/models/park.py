"""generator.park_learner: while the merged rollout copy decodes, the learner's state the copy never reads waits in host
memory, so the copy and its KV cache have the card (at Qwen3-8B's shape on 24 GiB the copy, its cache and the
learner's 5.66 GiB base do not fit together).

Parked: every 4-bit base weight's codes and its quant state (absmax, the nested absmax and codebooks), the LoRA weights
and AdamW's state. Not parked: what the copy shares with the learner (embeddings, norms, an unquantized head, rotary
buffers). Each tensor is copied into its slot of one host buffer per Lab (pinned, from a GPU; sized from the plan and
reused every rollout) and then emptied in place (`set_()`), so every tensor object and every reference to it stay
(the optimizer's, PEFT's, bitsandbytes' quant state); unparking puts its values back, bit for bit, also when the
rollout raises (an out-of-memory error, Ctrl-C). Why not resize the storage
to 0 bytes: a storage once shared with NumPy (`.numpy()`, as a user inspecting a weight does) can no longer be
resized."""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator, Optional

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


SLOT_ALIGN = 16  # bytes: each tensor's slot in the parking buffer starts at a multiple of this (a uint8 slice viewed
# as any dtype up to 8 bytes needs its offset divisible by the element size; planner/learner_items plans the padding)


class HostBuffer:
    """One contiguous host buffer, reused: grown only when asked for more than it holds, never shrunk. On a GPU it is
    pinned in place (cudaHostRegister, as torch's own checkpoint stager pins a plain tensor), so copies to and from it
    run asynchronously at the link's speed; why not `pin_memory=True`: torch's caching host allocator rounds a pinned
    block up to a power of two and keeps it (5.5 GiB asks for 8). On the CPU there is nothing to pin (pinning needs
    CUDA): the same buffer, plain, through the same code."""

    def __init__(self):
        self.tensor: Optional[torch.Tensor] = None  # uint8 [nbytes]
        self.pinned = False
        self.unpin: Optional[weakref.finalize] = None  # unregisters a pinned buffer: at free(), or when it is collected
        self.made = 0  # buffers made: 1 per Lab when the plan sized it

    def at_least(self, nbytes: int, pin: bool) -> torch.Tensor:
        """The buffer, grown to `nbytes` when smaller (why only then: its address stays the same every rollout)."""
        if self.tensor is None or self.tensor.numel() < nbytes or self.pinned != pin:
            self.free()
            self.tensor = torch.empty(nbytes, dtype=torch.uint8)  # why empty: every slot is written before it is read
            self.made += 1
            if pin:
                from torch.cuda._pin_memory_utils import pin_memory

                pin_memory(self.tensor.data_ptr(), nbytes)
                self.pinned = True
                self.unpin = weakref.finalize(self.tensor, _unpin, self.tensor.data_ptr())
        return self.tensor

    def free(self) -> None:
        """Let the buffer go (its memory back to the OS once no slot view holds it)."""
        if self.unpin is not None:
            self.unpin()  # (a finalizer runs at most once)
        self.tensor, self.pinned, self.unpin = None, False, None


def _unpin(ptr: int) -> None:
    from torch.cuda._pin_memory_utils import unpin_memory

    unpin_memory(ptr)


def slot_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor takes in the parking buffer: its values, rounded up to SLOT_ALIGN."""
    return -(-t.numel() * t.element_size() // SLOT_ALIGN) * SLOT_ALIGN


def synchronize(tensors: list[torch.Tensor]) -> None:
    """Wait for the non-blocking copies to or from GPU tensors among `tensors` (none on a CPU learner)."""
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)


class Parking:
    """A Lab's parked learner state, in one host buffer kept for the Lab's life: each tensor's values in a slot of it
    until that tensor is back on its device. Why held here, not in a context's locals: an out-of-memory error (or
    Ctrl-C) while putting the learner back left the rest of its tensors empty and dropped their only copies, and the
    next step crashed the process; now `put_back` goes on from the tensor it stopped at, at the Lab's next command
    (execution/local.py). Why one buffer: a fresh pinned tensor per parked tensor and rollout made ~3.3k blocking
    copies at 8B, and torch's pinned allocator kept ~1.26x the parked bytes for the Lab's life, on no plan line."""

    def __init__(self):
        self.held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the learner's tensor, its slot in the buffer)
        self.back = 0  # how many of `held` are on their device again (a put_back that raised goes on from here)
        self.buffer = HostBuffer()  # planned: planner/learner_items.parking_buffer_bytes

    @property
    def pending(self) -> int:
        """Tensors still waiting in host memory."""
        return len(self.held) - self.back

    def pending_bytes(self) -> int:
        return sum(host.numel() * host.element_size() for _, host in self.held[self.back :])

    def park(self, tensors: list[torch.Tensor], reserve: int = 0) -> int:
        """Copy each tensor into its slot of the buffer (at least `reserve` bytes: the plan's figure, so that it is
        made once), all copies started at once (non-blocking from a GPU) and awaited with one synchronize, then give
        each tensor's storage back; the bytes parked. A tensor is emptied only once every copy has landed, so an
        error at any tensor loses nothing."""
        self.put_back()  # (what an earlier rollout could not put back: before its slots are written again)
        slots = self.slots(tensors, reserve)
        with torch.no_grad():  # why: set_ on a parameter that requires grad
            for t, slot in zip(tensors, slots):
                self.to_host(t, slot)
            synchronize(tensors)  # why before any set_(): a storage given back while its copy runs would be reused
            for t, slot in zip(tensors, slots):
                self.held.append((t, slot))
                t.set_()  # an empty storage of this dtype and device: the old one is freed
        return self.pending_bytes()

    def slots(self, tensors: list[torch.Tensor], reserve: int) -> list[torch.Tensor]:
        """One view of the buffer per tensor, its dtype and shape, back to back at SLOT_ALIGN."""
        need = sum(slot_bytes(t) for t in tensors)
        buffer = self.buffer.at_least(max(need, reserve), pin=any(t.device.type == "cuda" for t in tensors))
        out, offset = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            out.append(buffer[offset : offset + nbytes].view(t.dtype).view(t.shape))
            offset += slot_bytes(t)
        return out

    @staticmethod
    def to_host(t: torch.Tensor, slot: torch.Tensor) -> None:
        slot.copy_(t, non_blocking=True)  # why non-blocking: one synchronize for all of them (park)

    @staticmethod
    def to_device(t: torch.Tensor, host: torch.Tensor) -> None:
        # why a copy even on the CPU: the slot is the buffer's, written again at the next park
        t.set_(host.to(t.device, copy=True, non_blocking=True))

    def put_back(self) -> None:
        """Every held tensor's values back on its device, in order; the slots are let go only once every tensor is
        back and its copy has landed. Raises as its copy raises (out of memory): the rest stay held, and a later call
        goes on."""
        with torch.no_grad():
            while self.back < len(self.held):
                self.to_device(*self.held[self.back])  # (a retry after Ctrl-C here sets the same values again)
                self.back += 1
        synchronize([t for t, _ in self.held])  # why: the buffer is written again at the next park
        self.held, self.back = [], 0  # why: every tensor is back; the buffer stays for the next rollout


@contextmanager
def parked(tensors: list[torch.Tensor], parking: "Parking | None" = None, reserve: int = 0) -> Iterator[int]:
    """Hold `tensors`' values in host memory for the block, their own storage given back; yields the bytes parked.
    Put back as the block ends, also when it raises; if putting back raises, `parking` still holds what is not back."""
    parking = Parking() if parking is None else parking
    try:
        yield parking.park(tensors, reserve)
    finally:
        parking.put_back()
