"""Reading memory: host (this process and its children, the system, the cgroup limit) and each
placed GPU (torch's allocator for this process, NVML for the whole device, which also sees vLLM
and other processes). Only the GPUs of the placement are ever touched, so no CUDA context is
created on a device the user did not choose.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import psutil

MiB = 1024 ** 2


def cgroup_limit() -> Optional[int]:
    """The memory limit of this process's cgroup (v2 or v1), or None when unlimited."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < psutil.virtual_memory().total:
            return int(text)
    return None


def cgroup_usage() -> Optional[int]:
    for path in ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"):
        try:
            return int(Path(path).read_text().strip())
        except (OSError, ValueError):
            continue
    return None


class HostProbe:
    """Host memory in bytes: `rss` (this process + children), `used` and `limit` (cgroup when one applies)."""
    device = "host"

    CHILDREN_REFRESH_S = 2.0

    def __init__(self):
        self.process = psutil.Process()
        self.limit = cgroup_limit()
        self._children: list = []
        self._children_at = float("-inf")

    def children(self) -> list:
        """Child processes (vLLM workers...), re-listed every 2 s: listing scans /proc (~1.5 ms), reading RSS does not."""
        now = time.monotonic()
        if now - self._children_at > self.CHILDREN_REFRESH_S:
            self._children, self._children_at = self.process.children(recursive=True), now
        return self._children

    def read(self) -> dict[str, float]:
        rss = self.process.memory_info().rss
        for child in self.children():
            try:
                rss += child.memory_info().rss
            except psutil.Error:
                pass  # a child that just exited
        vm = psutil.virtual_memory()
        if self.limit is not None:
            used, limit = cgroup_usage() or rss, self.limit
        else:
            used, limit = vm.total - vm.available, vm.total
        return {"rss": rss, "used": used, "limit": limit}


class CudaProbe:
    """One placed GPU: torch allocator figures for this process and NVML's device-wide used memory."""

    def __init__(self, device: str):
        import torch

        self.device = device
        self.index = int(device.split(":")[1])
        self.torch = torch
        self.total = torch.cuda.get_device_properties(self.index).total_memory
        self.nvml = _nvml_handle(self.index)

    def read(self) -> dict[str, float]:
        cuda = self.torch.cuda
        out = {"allocated": cuda.memory_allocated(self.index), "reserved": cuda.memory_reserved(self.index),
               "peak": cuda.max_memory_allocated(self.index), "total": self.total}
        if self.nvml is not None:
            import pynvml

            out["device_used"] = pynvml.nvmlDeviceGetMemoryInfo(self.nvml).used
        return out

    def reset_peak(self) -> None:
        self.torch.cuda.reset_peak_memory_stats(self.index)


def _nvml_handle(index: int):
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # nvidia-ml-py not installed or no driver: torch's figures still work
        return None


def probes_for(devices: list[str]) -> list:
    """A host probe plus one probe per distinct CUDA device of the placement."""
    out: list = [HostProbe()]
    for dev in dict.fromkeys(devices):
        if dev.startswith("cuda"):
            out.append(CudaProbe(dev))
    return out
