"""Each phase of a step as a named range for profilers: a torch.profiler `record_function` range (CPU and CUDA
traces, allocator snapshots' stacks) and, when the learner is on CUDA, an NVTX range (Nsight Systems), so a
trace of a grpo_lab step shows GRPO phases by name: `grpo_lab.rollout`, `grpo_lab.backward`, ...
Outside a profiler both cost a few microseconds per phase."""

from __future__ import annotations

from contextlib import contextmanager

import torch

PREFIX = "grpo_lab."


@contextmanager
def phase_range(name: str, cuda: bool):
    label = PREFIX + name
    with torch.profiler.record_function(label):
        if cuda:
            torch.cuda.nvtx.range_push(label)
        try:
            yield
        finally:
            if cuda:
                torch.cuda.nvtx.range_pop()
