"""A CPU rollout's decoding steps on pages the C heap keeps. Each step allocates the LM head's [rows, vocab] logits
and generate()'s float32 copy of them and frees both together at the heap's top; at glibc's own (rising) thresholds
the top trim threshold is twice the largest block it has unmapped, the two blocks' size, so every step gave the pages
back and faulted them in again (builtin:qwen2-152k's 2-turn tool rollout: ~650,000 minor faults, 7-14 % of its CPU
seconds; docs/benchmarks.md "A tool-calling rollout beside TRL's tool loop"). One block of twice a step's size,
mapped and freed before the rollout, raises glibc's thresholds as any freed block of that size would (no mallopt:
they keep rising on their own), so the step's freed top stays for the next step. No page of it is touched: RSS does
not change."""

from __future__ import annotations

import torch

# glibc raises its mmap threshold only for a freed block up to this size (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
GLIBC_RISING_MAX = 32 * 2**20


def keep_step_pages(rows: int, vocab: int) -> bool:
    """Map and free one block of two steps' [rows, vocab] float32 logits (+1 MiB); False where that is past what
    glibc's threshold rises to (the steps' blocks are mapped on their own then anyway)."""
    size = 2 * rows * vocab * 4 + 2**20
    if size > GLIBC_RISING_MAX:
        return False
    del_me = torch.empty(size, dtype=torch.uint8)  # why untouched: a mapped block's pages come in only when written
    del del_me
    return True
