"""Reading memory: host (this process and its children, the system or cgroup, its limit) and each
placed GPU (torch's allocator for this process, NVML for the whole device, which also sees vLLM
and other processes). Only the GPUs of the placement are ever touched, so no CUDA context is
created on a device the user did not choose.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import psutil

from ..runtime import nvml_handle

MiB = 1024**2


CGROUP_ROOT = Path("/sys/fs/cgroup")
# the kernel's peak RSS of this process (VmHWM) and its reset ("5" to clear_refs, Linux 4.0+): exact between readings
PROC_STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
# per cgroup version, relative to its root: the limit, the usage (which counts page cache), the stats, and the
# stat of page cache the kernel drops before it kills anything (kubelet subtracts it for its "working set")
CGROUP_FILES = (
    ("memory.max", "memory.current", "memory.stat", "inactive_file"),  # v2
    ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat", "total_inactive_file"),
)  # v1, whole subtree


def _read_int(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):  # absent, or "max" (v2's unlimited)
        return None


def _cgroup_files(root: Path) -> Optional[tuple[str, str, str, str]]:
    """The files of the cgroup version mounted at `root` (the first whose usage file reads), or None."""
    return next((files for files in CGROUP_FILES if _read_int(root / files[1]) is not None), None)


def cgroup_limit(root: Path = CGROUP_ROOT) -> Optional[int]:
    """The memory limit of the cgroup at `root` (v2 or v1), or None when unlimited (v1 writes a huge number)."""
    files = _cgroup_files(Path(root))
    limit = _read_int(Path(root) / files[0]) if files else None
    return limit if limit is not None and limit < psutil.virtual_memory().total else None


def cgroup_usage(root: Path = CGROUP_ROOT) -> Optional[int]:
    """The cgroup's raw usage: memory.current (v2) / memory.usage_in_bytes (v1), page cache included."""
    files = _cgroup_files(Path(root))
    return _read_int(Path(root) / files[1]) if files else None


def cgroup_working_set(root: Path = CGROUP_ROOT) -> Optional[int]:
    """Usage minus the inactive page cache (kubelet's working set): memory the cgroup cannot give back."""
    files = _cgroup_files(Path(root))
    if files is None:
        return None
    usage = _read_int(Path(root) / files[1])
    try:
        stats = dict(line.split() for line in (Path(root) / files[2]).read_text().splitlines() if line.strip())
        inactive = int(stats[files[3]])
    except (OSError, ValueError, KeyError):
        inactive = 0  # no stats: the raw usage, an over-estimate, so the guard errs on the safe side
    return None if usage is None else max(usage - inactive, 0)


class HostReader:
    """Host memory in bytes: `rss` (this process + children), `used` and `limit`.

    `used` is memory the kernel cannot reclaim, the same meaning everywhere: under a cgroup limit the
    cgroup's working set (usage minus inactive page cache, as kubelet evicts on), elsewhere total minus
    MemAvailable. Page cache from reading files (checkpoints, datasets) is left out: the kernel drops it
    before it kills anything, so counting it would trip the guard on memory that is free for the asking.
    `limit` is the cgroup's limit, else the host's total. `cgroup_root`: where the cgroup tree is mounted.
    `budget` (placement.host_memory_gib, bytes): a budget smaller than that limit is held as a cgroup limit would
    be: `limit` is the budget and `used` this process tree's RSS (a budget above it leaves the machine's figures).
    `kernel` (placement.host_limit: cgroup, memory/kernel_limit.py): the budget the kernel enforces, `used` what it
    counts against it.
    """

    device = "host"

    CHILDREN_REFRESH_S = 2.0

    def __init__(self, cgroup_root: Path = CGROUP_ROOT, budget: Optional[float] = None, kernel=None):
        self.process = psutil.Process()
        self.kernel = kernel
        self.cgroup_root = Path(cgroup_root)
        self.limit = cgroup_limit(self.cgroup_root)
        self.machine = self.limit if self.limit is not None else psutil.virtual_memory().total  # `limit` unbudgeted
        # why only a smaller budget: one above the machine plans a bigger host; this one is still guarded by its own
        self.budget = budget if budget is not None and budget < self.machine else None
        self._children: list = []
        self._children_at = float("-inf")
        self.exact = True  # the kernel keeps a resettable peak RSS for this process (set False at the first refusal)

    def children(self) -> list:
        """Child processes (vLLM workers...), re-listed every 2 s: listing scans /proc (~1.5 ms), reading RSS does
        not."""
        now = time.monotonic()
        if now - self._children_at > self.CHILDREN_REFRESH_S:
            self._children, self._children_at = self.process.children(recursive=True), now
        return self._children

    def reset_peak(self) -> None:
        """Restart the kernel's peak RSS of this process from its RSS now (a phase's start, a mark)."""
        if self.exact:
            try:
                CLEAR_REFS.write_text("5")
            except OSError:  # why: no such file (not Linux), no right to it, or a kernel before 4.0
                self.exact = False

    def peak(self) -> dict[str, float]:
        """The highest `rss` since `reset_peak`: the kernel's VmHWM of this process (it catches a spike freed before the
        next reading) plus its children's RSS now; also `used` where `used` is that RSS (a budget the kernel does not
        enforce). Empty where the kernel keeps no resettable peak: the samples alone then make a peak."""
        if not self.exact:
            return {}
        try:
            status = PROC_STATUS.read_text()
            hwm = int(status.split("VmHWM:", 1)[1].split("kB", 1)[0]) * 1024
        except (OSError, IndexError, ValueError):
            self.exact = False
            return {}
        rss = hwm + sum(self._rss(child) for child in self.children())
        used_is_rss = self.kernel is None and self.budget is not None
        return {"rss": rss, "used": rss} if used_is_rss else {"rss": rss}

    @staticmethod
    def _rss(process) -> int:
        try:
            return process.memory_info().rss
        except psutil.Error:
            return 0  # a child that just exited

    def read(self) -> dict[str, float]:
        rss = self.process.memory_info().rss
        rss += sum(self._rss(child) for child in self.children())
        used = self.kernel.used() if self.kernel is not None else None
        if used is not None:
            limit = self.kernel.budget
        elif self.budget is not None:
            used, limit = rss, self.budget
        elif self.limit is not None:
            working_set = cgroup_working_set(self.cgroup_root)
            used, limit = (rss if working_set is None else working_set), self.limit
        else:
            vm = psutil.virtual_memory()
            used, limit = vm.total - vm.available, vm.total  # MemAvailable already counts reclaimable cache
        return {"rss": rss, "used": used, "limit": limit}


def gpu_ledger(
    allocated: float,
    reserved: float,
    device_used: Optional[float],
    engine_books: float = 0.0,
    engine_resident: float = 0.0,
) -> dict[str, float]:
    """Where a GPU's memory went, as layers that stack to NVML's used: torch's live tensors (`allocated`), torch's
    cache of freed blocks and fragmentation (`cached` = reserved - allocated), an in-process vLLM engine (`engine`)
    and everything that is not this process's torch allocator (`not_torch` = the rest of NVML's device-wide used:
    another process's engine, CUDA contexts, NCCL buffers, other processes). Without NVML the last is unknown and
    left out.

    An in-process engine's tensors are this process's torch allocations: `engine_books` is what torch's figures
    count for it, also while it sleeps (vLLM unmaps its memory behind torch's back, so torch's reserved can then
    exceed NVML's used), and `engine_resident` what it holds on the device now (0 asleep). Its books come out of
    `allocated` and `reserved`; its resident bytes are its own layer."""
    out = {"allocated": allocated - engine_books, "reserved": reserved, "cached": reserved - allocated}
    if engine_books or engine_resident:
        out["engine"] = engine_resident
    if device_used is not None:
        out["device_used"] = device_used
        # why max: NVML and torch are read microseconds apart
        out["not_torch"] = max(0.0, device_used - (reserved - engine_books) - engine_resident)
    return out


class CudaReader:
    """One placed GPU: torch allocator figures for this process and NVML's device-wide used memory."""

    def __init__(self, device: str):
        import torch

        self.device = device
        self.index = int(device.split(":")[1])
        self.torch = torch
        self.total = torch.cuda.get_device_properties(self.index).total_memory
        self.nvml = nvml_handle(self.index)  # by UUID: NVML's indices ignore CUDA_VISIBLE_DEVICES
        self.engine = (
            None  # () -> (books, resident) of an in-process vLLM engine on this GPU (MemorySampler.attach_engine)
        )

    def read(self) -> dict[str, float]:
        cuda = self.torch.cuda
        used = None
        if self.nvml is not None:
            import pynvml

            used = pynvml.nvmlDeviceGetMemoryInfo(self.nvml).used
        books, resident = self.engine() if self.engine is not None else (0.0, 0.0)
        out = gpu_ledger(cuda.memory_allocated(self.index), cuda.memory_reserved(self.index), used, books, resident)
        return {**out, "peak": cuda.max_memory_allocated(self.index), "total": self.total}

    def reset_peak(self) -> None:
        self.torch.cuda.reset_peak_memory_stats(self.index)


def is_host(device: str) -> bool:
    """A host-RAM series: this process's ('host') or a sharded learner's rank's ('rank1/host')."""
    return device == "host" or device.endswith("/host")


def readers_for(devices: list[str], host_budget: Optional[float] = None, kernel=None) -> list:
    """A host reader (held to `host_budget` bytes, if given, or to the `kernel`'s limit: HostReader) plus one reader
    per distinct CUDA device of the placement."""
    out: list = [HostReader(budget=None if kernel else host_budget, kernel=kernel)]
    for dev in dict.fromkeys(devices):
        if dev.startswith("cuda"):
            out.append(CudaReader(dev))
    return out


def host_budget(config) -> Optional[float]:
    """placement.host_memory_gib in bytes (None: unset): what the planner plans the host at, and the guard holds."""
    gib = config.placement.host_memory_gib
    return gib * 1024**3 if gib else None
