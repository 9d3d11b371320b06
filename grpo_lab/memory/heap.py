"""Give the C heap's free pages back to the OS (glibc's malloc_trim; a no-op with another libc).

Why: a CPU rollout allocates and frees a few [sequences, vocab] buffers per decoding step (4.9 MB each at
8 x Qwen2.5's vocabulary) among small long-lived ones (the growing KV cache, the sampled tokens). glibc
serves them from its heap once its dynamic mmap threshold has risen, and the holes they leave fragment
it: RSS climbed up to 558 MiB above the rollout's start on logits-heavy-cpu, none of it live data
(bench/rollout_heap.py; trimmed, at most 153).
malloc_trim(0) returns every free page, holes included (madvise), so RSS tracks what is alive.

The same holes open inside a phase, where no trim runs: the log-prob head's chunk buffers (16 MiB of float32
logits at 128 x 32,000) come and go once per chunk. glibc maps a block of 128 KiB or more on its own, but raises
that threshold to the size of each mapped block it frees (up to 32 MiB), so from the second chunk on they come from
the heap, and RSS held 10-19 bytes per chunk element where the tensors are 6 (bench/head_heap.py). A fixed
threshold (mallopt(M_MMAP_THRESHOLD), which also stops the rise) maps every block above it and unmaps it when freed.
At 1 MiB the layers' sub-MiB activations still left holes at 1,024 tokens (backward +74-111 MiB over rest where
+64 is planned, varying run to run); at glibc's own 128 KiB floor, +41-57, the same in two runs.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

from ..errors import ConfigError


M_MMAP_THRESHOLD = -3   # glibc's malloc.h


@functools.lru_cache(maxsize=None)
def _libc_function(name: str):
    lib = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(lib), name) if lib else None
    except (OSError, AttributeError):   # musl, macOS: no malloc_trim / mallopt
        return None


def _malloc_trim():
    return _libc_function("malloc_trim")


def trim_host_heap() -> bool:
    """Return the heap's free pages to the OS; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


_pinned: list[float] = []   # the threshold this process pinned last (MiB), if any


def pin_mmap_threshold(mib: float | None) -> bool:
    """Map every C heap block of `mib` MiB or more on its own (returned to the OS when freed) and stop glibc's
    threshold from rising; None leaves glibc's own. Process-wide. False where the C library cannot (or None).
    None after a pin is refused: glibc has no way back to its rising threshold, so the knob could not take effect."""
    if mib is None:
        if _pinned:
            raise ConfigError(f"memory.host_mmap_threshold_mib: null, but an earlier Lab in this process pinned it at "
                              f"{_pinned[-1]:g} MiB and glibc cannot undo that; set {_pinned[-1]:g}, or restart the "
                              "kernel for glibc's own threshold")
        return False
    mallopt = _libc_function("mallopt")
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, int(mib * 1024 ** 2)):
        return False
    _pinned.append(mib)
    return True
