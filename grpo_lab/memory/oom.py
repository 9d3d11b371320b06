"""Out-of-memory errors become a LabError naming the phase, the device and the memory at failure.

The original exception and its traceback are dropped on purpose: a traceback keeps every frame
of the failed phase alive, and with them its tensors, so the memory would stay held in the
notebook kernel after the error (the classic "OOM once, OOM forever" kernel).
"""

from __future__ import annotations

import gc
import re
from typing import Optional

from ..errors import LabError
from .mark_fixes import at_mark, last_mark, mark_fix
from .readers import MiB


class OutOfMemory(LabError):
    """A phase ran out of device or host memory; the step's updates (if any) were rolled back."""


def is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower()
    )


def cuda_oom_count(device: str) -> int:
    """The OOMs torch's CUDA allocator counted on `device` in this process (memory_stats' num_ooms); 0 off CUDA. Why:
    a CUDA OOM inside backward's engine can reach Python as another exception (a SystemError), but it is counted."""
    import torch

    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory_stats(device).get("num_ooms", 0))


def oom_device(err: BaseException, default: str) -> str:
    if isinstance(err, MemoryError):
        return "host"
    found = re.search(r"GPU (\d+)", str(err))
    return f"cuda:{found.group(1)}" if found else default


def phase_error(
    err: BaseException, phase: str, step: int, device: str, sampler, undone: str, counted: bool = False
) -> Optional[LabError]:
    """What a failed phase raises instead of `err`: a one-line OutOfMemory for an out-of-memory error, or for any error
    while torch's allocator `counted` an OOM (cuda_oom_count rose); None for any other (the Lab re-raises `err`
    itself, told the step, or what was undone, where its message names them)."""
    from ..errors import NonFinite
    from .sampler import HostMemoryExceeded

    if isinstance(err, NonFinite):
        err.step = step
    elif isinstance(err, HostMemoryExceeded):
        err.undone = undone
        err.__context__ = None  # why: the live guard's may land while another error unwinds, holding its frames
    elif is_oom(err) or counted:
        return as_lab_error(err, phase, step, device, sampler, undone)
    return None


def release_memory() -> None:
    """Collect the failed phase's garbage and hand cached CUDA blocks back, so the next try starts clean."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # why: after an OOM the cache holds the failed phase's blocks


def as_lab_error(
    err: BaseException,
    phase: str,
    step: int,
    default_device: str,
    sampler=None,
    undone: str = "the step's updates were rolled back",
) -> OutOfMemory:
    device = oom_device(err, default_device)
    at = ""
    if sampler is not None:
        now = sampler.latest(device)
        figures = [
            f"{k} {v / MiB:.0f} MiB"
            for k, v in now.items()
            if k in ("rss", "used", "limit", "allocated", "cached", "not_torch", "total")
        ]
        at = f" ({', '.join(figures)})" if figures else ""
    # (a tool loop's turn it failed in: named, with the knobs that lower that turn's memory)
    mark = last_mark(sampler.segments, step, phase) if sampler is not None else None
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    if not is_oom(err):  # an OOM the allocator counted that reached Python as another error (phase_error)
        first = f"CUDA out of memory (torch's allocator counted it; Python saw {type(err).__name__}: {first})"
    return OutOfMemory(
        f"out of memory in phase {phase!r} of step {step}{at_mark(mark)} on {device}{at}: {first}; {undone}; "
        f"{mark_fix(mark) or 'lower grpo.micro_batch_size or generator.chunk_size'} and run it again"
    )
