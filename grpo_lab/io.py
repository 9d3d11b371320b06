"""Atomic file writes, so a crash or a bad input never leaves half a file behind."""
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


def atomic_write_text(path: Union[str, Path], text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o666 & ~_umask())  # why: mkstemp creates 0600; a run's files should read like any other
    os.replace(tmp, path)
    return path


def append_jsonl(path: Union[str, Path], record: dict) -> None:
    """One complete JSON line per call, flushed, so a killed run keeps every finished step."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def atomic_write_dir(path: Union[str, Path], write: Callable[[Path], None]) -> Path:
    """Let `write` fill a temporary sibling directory, then swap it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        write(tmp)
        os.chmod(tmp, 0o777 & ~_umask())
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
