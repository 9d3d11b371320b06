"""A host limit the kernel enforces (placement.host_limit: cgroup): this process is moved into a fresh memory cgroup
whose limit makes the kernel's OOM killer end it when its memory reaches placement.host_memory_gib, and the host guard
reads what the kernel counts against that limit, so the guard's line is the line the kernel enforces.

Where: a new group under the memory controller's root, cgroup v1's (`/sys/fs/cgroup/memory`, `memory.limit_in_bytes`)
or v2's where its memory controller is enabled for the root's children (`memory.max`); never inside the group this
process came from (a container's or a session's own). Needs root (mkdir under the root).

What the kernel counts: only what is charged to the group, the pages this process touches after the move. A moved
process's existing pages stay charged where they were (v1's memory.move_charge_at_immigrate is gone from current
kernels, and v2 never had it), so the group's limit is the budget less what this process holds as it moves (`held`,
its RSS then): the kernel kills when held + the group's charges pass the budget, and the guard reads `used` as the
same sum, the charges less the inactive page cache the kernel reclaims before it kills (memory.stat).

Removal: a group holding a process cannot be removed, and this process stays in it until it exits (moving it back
would write into the group it came from). A reaper (`sh`, started before the move so that it is not in the group)
removes the group once it is empty: as this process ends, killed or not. `lift()` (the Lab's close) unsets the limit
meanwhile.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Optional

import psutil

from ..errors import LabError

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
# per version: (the limit file, what "no limit" is written as)
LIMIT_FILES = {"v1": ("memory.limit_in_bytes", "-1"), "v2": ("memory.max", "max")}
# why a shell: the reaper outlives this process (a SIGKILL included) for ~1 MiB; it waits for the go (the move), then
# for the group to empty, then removes it; a go that never comes (EOF: this process died first) goes straight on
REAPER = 'read -r _; while read -r _ < "$1/cgroup.procs"; do sleep 0.2; done 2>/dev/null; rmdir "$1" 2>/dev/null'
FIX = "use placement.host_limit: budget (the guard holds the budget itself)"
_HELD: dict[Path, int] = {}  # group -> its process's RSS as it moved in (one move per process: a later Lab reuses it)


def controller() -> tuple[str, Path]:
    """(version, root) of the memory controller a new group can be made under, or a LabError saying why none can."""
    if os.geteuid() != 0:
        raise LabError(f"placement.host_limit: cgroup needs root to make a memory cgroup (uid {os.geteuid()}); {FIX}")
    if (V1_ROOT / "memory.limit_in_bytes").exists():
        return "v1", V1_ROOT
    for root in V2_ROOTS:
        try:
            if "memory" in (root / "cgroup.subtree_control").read_text().split():
                return "v2", root
        except OSError:
            continue
    raise LabError(
        "placement.host_limit: cgroup: no memory controller to make a group under (cgroup v1's /sys/fs/cgroup/memory "
        f"is not mounted, and cgroup v2's root does not enable memory for its children); {FIX}"
    )


def unavailable() -> Optional[str]:
    """Why no memory cgroup can be made here (one line), or None when one can (a probe group made and removed)."""
    try:
        _, root = controller()
        probe = root / f"grpo-lab-probe-{os.getpid()}"
        probe.mkdir()
        probe.rmdir()
    except (LabError, OSError) as err:
        return str(err)
    return None


def process_rss(pid: int) -> int:
    """The RSS of `pid` and its children, as the host guard counts a budget."""
    process = psutil.Process(pid)
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total


class KernelLimit:
    """This process (`pid`) in a fresh memory cgroup under the controller's root, the kernel killing it at `budget`
    bytes of memory in all (its RSS as it moved + the group's charges). `enforce` makes it; the HostReader reads
    `used`; `lift` unsets the limit."""

    def __init__(self, budget: Optional[float], threshold: float, pid: Optional[int] = None):
        if budget is None:
            raise LabError(
                "placement.host_limit: cgroup has no size; set placement.host_memory_gib (the GiB the kernel kills the "
                "Lab at) or use placement.host_limit: budget"
            )
        self.pid = pid or os.getpid()
        self.budget, self.threshold = int(budget), threshold
        self.version, root = controller()
        self.path = root / f"grpo-lab-{self.pid}"
        self.held = 0  # this process's RSS as it moved: charged elsewhere, counted here
        self.lifted = True  # no limit set (not enforced yet, or lifted)
        self.files = (
            ("memory.usage_in_bytes", "memory.stat", "total_inactive_file")
            if self.version == "v1"
            else ("memory.current", "memory.stat", "inactive_file")
        )

    def enforce(self) -> "KernelLimit":
        """Move the process into its group (made here, or its own from an earlier Lab), its limit the budget less what
        it holds now; refused in one line when that is not below the guard's line."""
        made = self.path not in _HELD or not self.path.exists()
        self.held = process_rss(self.pid) if made else _HELD[self.path]
        holds = self.held + (0 if made else self.charged() or 0)
        if holds >= self.budget * self.threshold:
            raise LabError(
                f"placement.host_memory_gib: {self.budget / 1024**3:g} GiB is below what this process already holds "
                f"({holds / 1024**3:.2f} GiB, at or past the guard's line at memory.host_threshold "
                f"{self.threshold:g}); raise it above {holds / self.threshold / 1024**3:.2f} GiB"
            )
        if made:
            if self.path.exists():
                self.path.rmdir()  # why: a group a process of this pid left (its reaper did not run); empty, or refused
            self.path.mkdir()
        try:
            self._write(LIMIT_FILES[self.version][0], str(self.budget - self.held))
            if made:
                self._move_in()
                _HELD[self.path] = self.held
            self.lifted = False
        except BaseException:
            if made:
                self.path.rmdir()  # why: nothing half-made is left behind (the process never moved in)
            raise
        return self

    def _move_in(self) -> None:
        reaper = subprocess.Popen(
            ["sh", "-c", REAPER, "grpo-lab-reaper", str(self.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # why: a Ctrl-C or a kill of this process's group leaves it to finish its work
        )
        try:
            self._write("cgroup.procs", str(self.pid))
        except BaseException:
            reaper.kill()
            reaper.wait()
            raise
        reaper.stdin.write(b"go\n")
        reaper.stdin.close()
        self.reaper = reaper

    def _write(self, name: str, value: str) -> None:
        try:
            (self.path / name).write_text(value)
        except OSError as err:
            raise LabError(
                f"placement.host_limit: cgroup: writing {value} to {self.path / name} failed ({err}); {FIX}"
            ) from None

    def charged(self) -> Optional[int]:
        """What the kernel counts against the limit that it will not reclaim first: the group's usage less its inactive
        page cache (None: the group is gone)."""
        usage_file, stat_file, inactive_key = self.files
        try:
            usage = int((self.path / usage_file).read_text())
        except (OSError, ValueError):
            return None
        try:
            stats = dict(line.split() for line in (self.path / stat_file).read_text().splitlines() if line.strip())
            inactive = int(stats[inactive_key])
        except (OSError, ValueError, KeyError):
            inactive = 0  # why: the raw usage over-counts, so the guard errs on the safe side
        return max(usage - inactive, 0)

    def used(self) -> Optional[int]:
        """The memory the kernel holds this process to: its RSS as it moved plus the group's unreclaimable charges."""
        charged = self.charged()
        return None if charged is None else self.held + charged

    def lift(self) -> None:
        """Unset the group's limit (the Lab closed); the process stays in its group until it exits."""
        try:
            (self.path / LIMIT_FILES[self.version][0]).write_text(LIMIT_FILES[self.version][1])
        except OSError:
            pass  # why: the group is already gone
        self.lifted = True
