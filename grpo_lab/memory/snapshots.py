"""CUDA allocator snapshots per phase (`torch.cuda.memory._record_memory_history`), written as
`step{N}-{phase}.pickle` for https://pytorch.org/memory_viz. A Timeline listener; off by default
because recording stack traces for every allocation slows a step noticeably."""
from __future__ import annotations

import warnings
from pathlib import Path


class AllocatorSnapshots:
    def __init__(self, directory: str | Path, devices: list[str]):
        import torch

        self.enabled = torch.cuda.is_available() and any(d.startswith("cuda") for d in devices)
        self.directory = Path(directory)
        if not self.enabled:
            warnings.warn("memory.cuda_snapshots: no CUDA device in the placement; allocator snapshots skipped",
                          stacklevel=2)

    def phase_started(self, step: int, phase: str) -> None:
        if self.enabled:
            import torch

            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def phase_ended(self, record, error) -> None:
        if self.enabled:
            import torch

            self.directory.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(self.directory / f"step{record.step}-{record.phase}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)  # why: recording costs time and memory between phases
