"""A CPU generate() call's LM head writes each step's [rows, 1, vocab] logits into one buffer kept for the call.

Why: a decoding step allocated the LM head's logits and generate()'s float32 copy of them and freed both together at
the C heap's top; glibc's own trim threshold is twice the largest block it has unmapped (the step's one block), so
the two freed blocks together passed it and every step gave their pages back and faulted them in again
(builtin:qwen2-152k's 2-turn tool rollout: ~650,000 minor faults; docs/benchmarks.md "A tool-calling rollout beside
TRL's tool loop"). With the logits kept, a step frees generate()'s copy alone, one block under that threshold, and
its pages stay for the next step. Nothing is raised process-wide. The buffer is the step's logits the plan already
counts (generation/step_memory.py decode_step_bytes): one [rows, vocab] block, held from the call's first LM-head
forward to its end, as the last step's logits were.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch


class KeptLogits:
    """The LM head's forward for a generate() call: a [rows, 1, hidden] input's logits go into `self.buffer` (made at
    the first such call, made again if the rows change), by the same matmul `nn.Linear` runs; any other input (a
    prefill that keeps more positions) goes to the head's own forward."""

    def __init__(self, head: torch.nn.Linear):
        self.head, self.forward = head, head.forward
        self.buffer: Optional[torch.Tensor] = None
        self.made = 0  # buffers made (a test reads it: one per call and rows)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight
        if hidden.dim() != 3 or hidden.shape[1] != 1 or hidden.dtype != weight.dtype or torch.is_grad_enabled():
            return self.forward(hidden)
        shape = (hidden.shape[0], 1, weight.shape[0])
        if self.buffer is None or self.buffer.shape != shape:
            self.buffer = None  # (the old one let go before the new one is made)
            self.buffer = torch.empty(shape, dtype=weight.dtype)
            self.made += 1
        # why matmul: F.linear without a bias is this matmul (the same kernel, so the same logits bit for bit)
        return torch.matmul(hidden, weight.t(), out=self.buffer)


def keeps_logits(head, device_type: str, compiled: bool = False) -> bool:
    """Whether `head` can write into a kept buffer: a plain bias-free nn.Linear (not a PEFT or quantised wrapper) on
    a CPU learner (a GPU's freed blocks stay in torch's caching allocator: nothing to keep), its forward not compiled
    (generator.hf_decode compiled: the graph is torch's own)."""
    return device_type == "cpu" and not compiled and type(head) is torch.nn.Linear and head.bias is None


@contextmanager
def kept_logits(model, device_type: str, compiled: bool = False):
    """For the generate() calls inside: the model's LM head writes into one kept buffer (KeptLogits), where it can;
    the head's own forward again after, the buffer let go. Yields the KeptLogits, or None where left alone."""
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
        kept.buffer = None
