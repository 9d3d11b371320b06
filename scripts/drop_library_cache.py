"""Drop the page cache of the environment's shared libraries (clean pages only: nothing is written or deleted).

Why: a library file that an install wrote, or that something read with read(), sits in the page cache as large
folios, and a process that maps the library then maps them whole: its RSS read up to ~100 MiB above what the same
process reads once the pages come in by mapping (notebook 07's first turn at 0.84-0.88 of its plan, a plain process's
baseline 597 MiB against the plan's 572; both back within the plan with the cache dropped). The suite holds measured
RSS to plans, so scripts/test.sh starts from here.

    python scripts/drop_library_cache.py [DIR ...]      # default: .venv and the interpreter's own prefix
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def drop(root: Path) -> int:
    """posix_fadvise(DONTNEED) on every shared library under `root`; returns how many were dropped."""
    count = 0
    for path in root.rglob("*.so*"):
        if path.is_symlink() or not path.is_file():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        finally:
            os.close(fd)
    return count


if __name__ == "__main__":
    roots = [Path(p) for p in sys.argv[1:]] or [Path(".venv"), Path(sys.base_prefix) / "lib"]
    print(f"page cache dropped for {sum(drop(r) for r in roots if r.is_dir())} shared libraries")
