"""CUDA allocator snapshots per phase (`torch.cuda.memory._record_memory_history`), written as
`step{N}-{phase}.pickle` for https://pytorch.org/memory_viz; a phase that runs out of memory writes
`step{N}-{phase}-oom.pickle` (taken before the failed phase's tensors are freed, so it shows what filled
the device), one that fails otherwise `-failed`, so the retry's snapshot does not overwrite it. A Timeline
listener; off by default because recording stack traces for every allocation slows a step noticeably."""

from __future__ import annotations

import warnings
from pathlib import Path


def snapshot_name(step: int, phase: str, error: BaseException | None) -> str:
    from .oom import is_oom

    outcome = "" if error is None else "-oom" if is_oom(error) else "-failed"
    return f"step{step}-{phase}{outcome}.pickle"


class AllocatorSnapshots:
    def __init__(self, directory: str | Path, devices: list[str]):
        import torch

        self.enabled = torch.cuda.is_available() and any(d.startswith("cuda") for d in devices)
        self.directory = Path(directory)
        if not self.enabled:
            warnings.warn(
                "memory.cuda_snapshots: no CUDA device in the placement; allocator snapshots skipped", stacklevel=2
            )

    def phase_started(self, step: int, phase: str) -> None:
        if self.enabled:
            import torch

            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def phase_ended(self, record, error) -> None:
        if self.enabled:
            import torch

            self.directory.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(self.directory / snapshot_name(record.step, record.phase, error)))
            # why: recording costs time and memory between phases
            torch.cuda.memory._record_memory_history(enabled=None)
