"""Atomic file writes, so a crash or a bad input never leaves half a file behind.

A directory (the adapter, the built-in model) is written into `.NAME.tmp-*`, fsynced, then
swapped in with two renames (NAME -> .NAME.old, tmp -> NAME). A crash can leave: a `.tmp-*`
(unfinished: removed), `.NAME.old` beside NAME (finished: removed), or `.NAME.old` alone (the
crash fell between the renames: it is the last complete version and goes back). `recover_dir`
does that; every write starts with it, and readers call it before they look.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Union


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Union[str, Path], text: Union[str, bytes]) -> Path:
    """Write `text` (or bytes) to `path` through a temporary file and a rename, fsynced: the file's data before the
    rename, the directory entry after it (a rename is only as durable as what it names)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # why: mkstemp creates 0600; a run's files should read like any other
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # why: nothing half-written is left behind
        raise
    _fsync_dir(path.parent)
    return path


def append_jsonl(path: Union[str, Path], record: dict) -> None:
    """One complete JSON line per call, flushed, so a killed run keeps every finished step."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def _old(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def recover_dir(path: Union[str, Path]) -> Path:
    """Put back what an interrupted `atomic_write_dir` left (see the module docstring); returns `path`.
    One writer per directory is assumed (the callers hold a lock or own the run directory)."""
    path = Path(path)
    old = _old(path)
    if old.exists():
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, path)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return path


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under `root` to disk (why: a rename is only as durable as what it names)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_dir(path: Union[str, Path], write: Callable[[Path], None]) -> Path:
    """Let `write` fill a temporary sibling directory, then swap it into place (recovering first)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        write(tmp)
        os.chmod(tmp, 0o777 & ~_umask())
        _fsync_tree(tmp)
        old = _old(path)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
