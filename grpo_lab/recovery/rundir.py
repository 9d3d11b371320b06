"""A run directory's state: new, running (locked by a live process), unfinished (killed or failed:
resumable) or finished; and putting its files back to a checkpoint before a resume.

`run.json` says what the runner last knew ({"status": "running"|"failed"|"finished", "steps": N}).
A process killed with SIGKILL cannot update it, so "running" with no lock held means killed. The
lock is an flock on `.lock`, which the kernel releases when the process dies, however it dies.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import LabError
from ..files import atomic_write_text

STATUS, LOCK, CHECKPOINT, METRICS, CONFIG = "run.json", ".lock", "checkpoint", "metrics.jsonl", "config.yaml"


@dataclass
class RunState:
    path: Path
    status: str  # "new", "finished", "unfinished"
    steps: Optional[int]  # the run's target, when known
    done: int  # steps in metrics.jsonl
    checkpoint: Optional[int]  # the step a resume starts at (None: no checkpoint)

    def describe(self) -> str:
        at = f"checkpoint at step {self.checkpoint}" if self.checkpoint is not None else "no checkpoint yet"
        of = f" of {self.steps}" if self.steps else ""
        return f"{self.done}{of} steps done, {at}"


def read_state(path: Path) -> RunState:
    from .checkpoint import read_checkpoint

    path = Path(path)
    if not ((path / METRICS).exists() or (path / CONFIG).exists()):
        return RunState(path, "new", None, 0, None)
    info = read_status(path)
    checkpoint = None
    if (path / CHECKPOINT).exists() or (path / f".{CHECKPOINT}.old").exists():
        checkpoint = read_checkpoint(path / CHECKPOINT).step
    status = "finished" if info.get("status") == "finished" else "unfinished"
    return RunState(path, status, info.get("steps"), len(complete_lines(path / METRICS)), checkpoint)


def read_status(path: Path) -> dict:
    try:
        return json.loads((path / STATUS).read_text())
    except (OSError, ValueError):
        return {}


def write_status(path: Path, status: str, steps: int, error: Optional[str] = None) -> None:
    record = {"status": status, "steps": steps, **({"error": error} if error else {})}
    atomic_write_text(path / STATUS, json.dumps(record) + "\n")


def complete_lines(path: Path) -> list[str]:
    """The metrics lines of finished steps, in order: a line cut short by a kill is not one of them."""
    lines = []
    try:
        text = path.read_text()
    except OSError:
        return lines
    for line in text.splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            break
        if not line.endswith("\n") or record.get("step") != len(lines):
            break
        lines.append(line)
    return lines


def rewind_metrics(path: Path, step: int) -> list[dict]:
    """Keep the metrics of the steps before `step` (the rest will be run again); returns them."""
    kept = complete_lines(path)[:step]
    atomic_write_text(path, "".join(kept))
    return [json.loads(line) for line in kept]


def _try_lock(path: Path) -> Optional[int]:
    """An fd holding the directory's flock, or None when another open file holds it."""
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class RunLock:
    """One process per run directory; released by the kernel when the holder dies, however it dies."""

    def __init__(self, path: Path, field: str):
        self.path, self.field, self.fd = Path(path), field, None

    def __enter__(self) -> "RunLock":
        return self if self.fd is not None else self.acquire()

    def acquire(self) -> "RunLock":
        self.path.mkdir(parents=True, exist_ok=True)
        self.fd = _try_lock(self.path)
        if self.fd is None:
            raise LabError(
                f"{self.field}: {str(self.path)!r} is in use by another grpo-lab run that is still going; "
                "wait for it, or choose another directory"
            )
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def is_locked(path: Path) -> bool:
    if not (Path(path) / LOCK).exists():
        return False
    fd = _try_lock(Path(path))
    if fd is None:
        return True
    os.close(fd)  # closing drops the lock this check took
    return False
