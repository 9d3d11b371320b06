"""CUDA allocator snapshots per phase (`torch.cuda.memory._record_memory_history`), written as
`step{N}-{phase}.pickle` for https://pytorch.org/memory_viz; a phase that runs out of memory writes
`step{N}-{phase}-oom.pickle` (taken before the failed phase's tensors are freed, so it shows what filled
the device), one that fails otherwise `-failed`, so the retry's snapshot does not overwrite it. A Timeline
listener; off by default because recording stack traces for every allocation slows a step noticeably."""

from __future__ import annotations

import warnings
from pathlib import Path

from .oom import cuda_oom_count, is_oom


def snapshot_name(step: int, phase: str, error: BaseException | None, counted: bool = False) -> str:
    """`counted`: torch's allocator counted an OOM during the phase (an OOM that reached Python as another error)."""
    outcome = "" if error is None else "-oom" if is_oom(error) or counted else "-failed"
    return f"step{step}-{phase}{outcome}.pickle"


class AllocatorSnapshots:
    def __init__(self, directory: str | Path, devices: list[str]):
        import torch

        self.enabled = torch.cuda.is_available() and any(d.startswith("cuda") for d in devices)
        self.directory = Path(directory)
        self.devices = [d for d in devices if d.startswith("cuda")]
        self.ooms = 0  # the allocator's OOM count over those devices when the phase started
        if not self.enabled:
            warnings.warn(
                "memory.cuda_snapshots: no CUDA device in the placement; allocator snapshots skipped", stacklevel=2
            )

    def oom_count(self) -> int:
        return sum(cuda_oom_count(d) for d in self.devices)

    def phase_started(self, step: int, phase: str) -> None:
        if self.enabled:
            import torch

            self.ooms = self.oom_count()
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def phase_ended(self, record, error) -> None:
        if self.enabled:
            import torch

            self.directory.mkdir(parents=True, exist_ok=True)
            counted = error is not None and self.oom_count() > self.ooms
            name = snapshot_name(record.step, record.phase, error, counted)
            torch.cuda.memory._dump_snapshot(str(self.directory / name))
            # why: recording costs time and memory between phases
            torch.cuda.memory._record_memory_history(enabled=None)
