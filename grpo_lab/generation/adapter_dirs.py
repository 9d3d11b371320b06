"""Where the vLLM generator writes the LoRA adapters it loads each step: a fresh directory per process, RAM-backed
(/dev/shm) when it has room, else the temp directory, named after its owner so that a later process removes the
directories of processes that are gone (killed, crashed) and never a live one's."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Optional

from ..errors import LabError

ADAPTER_MARGIN = 16 * 1024**2  # why: adapter_config.json and safetensors headers, and room for what else writes there


def pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc: one namespace
        return 0


def adapter_dir_prefix(pid: Optional[int] = None) -> str:
    """`grpo-lab-lora-<pid>-<pid namespace>-`: its owner, so that a later process can tell a stale directory from
    a live one (a pid from another namespace, e.g. another container sharing /tmp, means nothing here)."""
    return f"grpo-lab-lora-{os.getpid() if pid is None else pid}-{pid_namespace()}-"


def remove_stale_adapter_dirs(roots) -> list[Path]:
    """Remove the adapter directories of processes that are gone (killed, crashed: no exit handler ran);
    a live process's directory is never touched. Returns what was removed."""
    import psutil

    ours = re.compile(rf"^grpo-lab-lora-(\d+)-{pid_namespace()}-")
    removed = []
    for root in roots:
        for path in sorted(Path(root).glob("grpo-lab-lora-*")):
            owner = ours.match(path.name)
            if owner and path.is_dir() and not psutil.pid_exists(int(owner.group(1))):
                shutil.rmtree(path, ignore_errors=True)  # another user's (a shared /tmp) may stay: not ours to remove
                if not path.exists():
                    removed.append(path)
    return removed


def choose_adapter_dir(candidates: list[tuple[str, int]], needed: int) -> tuple[str, Optional[str]]:
    """The first (directory, free bytes) with `needed` bytes free, and a one-line notice when it is not the first."""
    mib = lambda n: f"{n / 1024**2:.0f} MiB"  # noqa: E731
    for path, free in candidates:
        if free >= needed:
            first, first_free = candidates[0]
            notice = (
                None
                if path == first
                else (
                    f"generator: {first} has {mib(first_free)} free, under the {mib(needed)} "
                    f"the LoRA adapter syncs need; writing them to {path} instead"
                )
            )
            return path, notice
    have = " and ".join(f"{path} has {mib(free)}" for path, free in candidates)
    raise LabError(
        f"generator: the LoRA adapter syncs need {mib(needed)} free, but {have}; free space there, "
        "or set TMPDIR to a directory with room"
    )


def make_adapter_dir(learner) -> Path:
    """A fresh adapter directory, RAM-backed (/dev/shm) when it has room, else in the temp directory."""
    shm = Path("/dev/shm")
    # why RAM-backed first: adapters are written every step; tmpfs keeps that off the disk
    roots = list(dict.fromkeys(([str(shm)] if shm.is_dir() else []) + [tempfile.gettempdir()]))
    remove_stale_adapter_dirs(roots)
    adapter = sum(p.numel() * p.element_size() for p in learner.trainable_parameters().values())
    # why x2: a sync writes the new adapter before the old one is removed
    root, notice = choose_adapter_dir([(r, shutil.disk_usage(r).free) for r in roots], 2 * adapter + ADAPTER_MARGIN)
    if notice:
        warnings.warn(notice, stacklevel=3)
    return Path(tempfile.mkdtemp(prefix=adapter_dir_prefix(), dir=root))
