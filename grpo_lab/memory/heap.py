"""Give the C heap's free pages back to the OS (glibc's malloc_trim; a no-op with another libc).

Why: a CPU rollout allocates and frees a few [sequences, vocab] buffers per decoding step (4.9 MB each at
8 x Qwen2.5's vocabulary) among small long-lived ones (the growing KV cache, the sampled tokens). glibc
serves them from its heap once its dynamic mmap threshold has risen, and the holes they leave fragment
it: RSS climbed up to 558 MiB above the rollout's start on logits-heavy-cpu, none of it live data
(bench/rollout_heap.py; trimmed, at most 153).
malloc_trim(0) returns every free page, holes included (madvise), so RSS tracks what is alive.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):   # musl, macOS: no malloc_trim
        return None


def trim_host_heap() -> bool:
    """Return the heap's free pages to the OS; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
