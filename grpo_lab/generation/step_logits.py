"""A CPU generate() call's decoding steps on one kept [rows, vocab] buffer: the LM head writes each step's logits
into it, and generate()'s float32 copy of the last position's logits is a view of it (of a second kept float32
buffer where the head computes in a lower precision), so a step allocates and frees no [rows, vocab] block.

Why: a step allocated the LM head's logits and generate()'s float32 copy of them and freed both together at the C
heap's top; glibc's own trim threshold is twice the largest block it has unmapped (the step's one block), so the two
freed blocks together passed it and the step gave their pages back and faulted them in again (builtin:qwen2-152k's
2-turn tool rollout: ~100,000-650,000 minor faults; docs/benchmarks.md "A tool-calling rollout beside TRL's tool
loop"). Nothing is raised process-wide. Why a view is safe: generate() copies the logits only so as not to hold the
model's whole output; nothing reads a step's logits once the next forward starts (no output_scores /
output_logits), and the processors (generation/sampling.py) write over the scores in place, as they did the copy.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch


class StepLogits(torch.Tensor):
    """The kept logits as generate() reads them: `logits[:, -1]` stays a StepLogits, and its float32 copy
    (`.to(copy=True, dtype=torch.float32)`, transformers' `_sample`) is a fresh plain view of the kept float32 buffer
    (a new tensor each step: DecodeStep.release lets go of the one generate() holds). Anything else runs as on a
    plain tensor and returns plain tensors."""

    kept: "KeptLogits"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0] if args else None
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.Tensor.__getitem__ and isinstance(self, StepLogits):
                return self.kept.wrap(func(*args, **kwargs))
            if func is torch.Tensor.to and isinstance(self, StepLogits) and self.kept.copies(args, kwargs):
                return self.kept.float32(self)
            return func(*args, **kwargs)


class KeptLogits:
    """The LM head's forward for a generate() call: a [rows, 1, hidden] input's logits go into `self.buffer` (made at
    the first such call, made again if the rows change), by the matmul `nn.Linear` runs, handed back as a StepLogits;
    any other input (a forward that keeps more positions, autograd or autocast on) goes to the head's own forward."""

    def __init__(self, head: torch.nn.Linear):
        self.head, self.forward = head, head.forward
        self.buffer: Optional[torch.Tensor] = None  # [rows, 1, vocab] in the head's dtype
        self.scores: Optional[torch.Tensor] = None  # [rows, vocab] float32: the buffer itself when it is float32
        self.made = 0  # buffers made (a test reads it: one per call and rows)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight
        if hidden.dim() != 3 or hidden.shape[1] != 1 or hidden.dtype != weight.dtype or self.elsewhere():
            return self.forward(hidden)
        shape = (hidden.shape[0], 1, weight.shape[0])
        if self.buffer is None or self.buffer.shape != shape:
            self.buffer = self.scores = None  # (the old ones let go before the new ones are made)
            self.buffer = torch.empty(shape, dtype=weight.dtype)
            f32 = weight.dtype == torch.float32
            self.scores = self.buffer[:, 0] if f32 else torch.empty(shape[0], shape[2], dtype=torch.float32)
            self.made += 1
        # why mm over the rows: F.linear without a bias folds its input so (same kernel: same logits bit for bit)
        torch.mm(hidden.reshape(shape[0], -1), weight.t(), out=self.buffer.view(shape[0], shape[2]))
        return self.wrap(self.buffer)

    @staticmethod
    def elsewhere() -> bool:
        """Whether the forward is not a plain no-grad one (autograd, or autocast choosing the matmul's dtype): the
        head's own then."""
        return torch.is_grad_enabled() or torch.is_autocast_enabled("cpu")

    def wrap(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.as_subclass(StepLogits)
        out.kept = self
        return out

    @staticmethod
    def copies(args, kwargs) -> bool:
        """Whether a `.to(...)` call is generate()'s float32 copy of the logits on the CPU."""
        device = kwargs.get("device")
        return (
            len(args) == 1
            and kwargs.get("copy") is True
            and kwargs.get("dtype") == torch.float32
            and (device is None or torch.device(device).type == "cpu")
            and set(kwargs) <= {"copy", "dtype", "device"}
        )

    def float32(self, last: torch.Tensor) -> torch.Tensor:
        """generate()'s float32 copy of `last` (a [rows, vocab] view of the buffer): a new view of `self.scores`."""
        plain = last.as_subclass(torch.Tensor)
        if plain.shape != self.scores.shape or plain.data_ptr() != self.buffer.data_ptr():
            return plain.to(dtype=torch.float32, copy=True)  # (not the kept buffer's last position: a copy)
        if self.scores.data_ptr() != plain.data_ptr():
            self.scores.copy_(plain)
        return self.scores.view(self.scores.shape)


def keeps_logits(head, device_type: str, compiled: bool = False) -> bool:
    """Whether `head` can write into a kept buffer: a plain bias-free nn.Linear (not a PEFT or quantised wrapper) with
    a plain weight (not a sharded DTensor) on a CPU learner (a GPU's freed blocks stay in torch's caching allocator:
    nothing to keep), its forward not compiled (generator.hf_decode compiled: the graph is torch's own)."""
    plain = type(head) is torch.nn.Linear and head.bias is None
    return device_type == "cpu" and not compiled and plain and type(head.weight) in (torch.Tensor, torch.nn.Parameter)


@contextmanager
def kept_logits(model, device_type: str, compiled: bool = False):
    """For the generate() calls inside: the model's LM head writes into one kept buffer (KeptLogits), where it can;
    the head's own forward again after, the buffers let go. Yields the KeptLogits, or None where left alone."""
    head = model.get_output_embeddings()
    if not keeps_logits(head, device_type, compiled):
        yield None
        return
    kept, patched = KeptLogits(head), head.__dict__.get("forward")  # (an instance's own forward, put back after)
    head.forward = kept
    try:
        yield kept
    finally:
        if patched is None:
            del head.forward
        else:
            head.forward = patched
        kept.buffer = kept.scores = None
