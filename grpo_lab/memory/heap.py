"""Give the C heap's free pages back to the OS (glibc's malloc_trim; a no-op with another libc), and optionally pin
glibc's mmap threshold. Why: freed [sequences, vocab] buffers and the log-prob head's chunks leave heap holes that
RSS keeps, so host memory would stop tracking live tensors (figures: docs/benchmarks.md, "The CPU rollout's heap").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from ..errors import ConfigError

M_MMAP_THRESHOLD = -3  # glibc's malloc.h


@functools.lru_cache(maxsize=None)
def _libc_function(name: str):
    lib = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(lib), name) if lib else None
    except (OSError, AttributeError):  # musl, macOS: no malloc_trim / mallopt
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


_pinned: list[float] = []  # the threshold this process pinned last (MiB), if any


def pin_mmap_threshold(mib: float | None) -> bool:
    """Map every C heap block of `mib` MiB or more on its own (returned to the OS when freed) and stop glibc's
    threshold from rising; None leaves glibc's own. Process-wide. False where the C library cannot (or None).
    None after a pin is refused: glibc has no way back to its rising threshold, so the knob could not take effect."""
    if mib is None:
        if _pinned:
            raise ConfigError(
                f"memory.host_mmap_threshold_mib: null, but an earlier Lab in this process pinned it at "
                f"{_pinned[-1]:g} MiB and glibc cannot undo that; set {_pinned[-1]:g}, or restart the "
                "kernel for glibc's own threshold"
            )
        return False
    mallopt = _libc_function("mallopt")
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, int(mib * 1024**2)):
        return False
    _pinned.append(mib)
    return True


def trim_before_each_layer(layers) -> list:
    """Trim the C heap as each of `layers` starts a full-sequence forward (a log-prob pass, backward's recompute, a
    rollout's prefill; never a one-token decode step). Why: at glibc's own mmap threshold a pass's freed activations
    stay resident as heap holes until the next trim, and a phase-start trim leaves one pass's worth of them (the
    first steps of a 151,936-vocabulary run peaked 1.05-1.23x the plan); trimmed per layer, at most one layer's.
    Returns the hook handles."""

    def trim(module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if hidden is not None and hidden.dim() >= 2 and hidden.shape[-2] > 1:
            trim_host_heap()

    return [layer.register_forward_pre_hook(trim, with_kwargs=True) for layer in layers]
