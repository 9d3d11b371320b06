"""Checks of the paths a user gives (run and sweep directories, the tiny model's directory, config,
dataset and notebook files). Each problem is one `LabError` naming the flag or field, raised before
anything is loaded or written: a directory that is a file, lies under a file or cannot be written;
a file that is missing, a directory, unreadable or not UTF-8 text."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Union

from ..errors import LabError

PathLike = Union[str, Path]


def check_output_dir(path: PathLike, what: str) -> Path:
    """`path` is a directory that exists or can be created, and can be written; returns it.

    Probes for real (creates and removes an empty temporary directory in the nearest existing
    ancestor): permission bits do not tell, for root, for read-only mounts or for /proc."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise LabError(f"{what}: {str(path)!r} is a file, not a directory; give a directory path")
    ancestor = path
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        kind = "a broken link" if os.path.islink(ancestor) and not ancestor.exists() else "a file, not a directory"
        raise LabError(
            f"{what}: cannot create {str(path)!r}: {str(ancestor)!r} is {kind}; choose a path that is not under a file"
        )
    try:
        os.rmdir(tempfile.mkdtemp(dir=ancestor, prefix=".grpo-lab-write-check-"))
    except OSError as err:
        raise LabError(
            f"{what}: cannot write in {str(ancestor)!r} ({err.strerror}); choose a writable directory"
        ) from None
    return path


def check_input_file(path: PathLike, what: str, missing: str = "") -> Path:
    """`path` is an existing regular file; `missing` is the fix to name when it does not exist."""
    path = Path(path)
    if path.is_dir():
        raise LabError(f"{what}: {str(path)!r} is a directory, not a file; give the file's path")
    if not path.exists():
        raise LabError(f"{what}: {str(path)!r} does not exist" + (f"; {missing}" if missing else ""))
    if not path.is_file():
        raise LabError(f"{what}: {str(path)!r} is not a regular file; give the path of a file")
    return path


def read_text(path: PathLike, what: str, missing: str = "") -> str:
    """The UTF-8 text of an existing regular file; any problem is one LabError naming `what`."""
    path = check_input_file(path, what, missing)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise LabError(f"{what}: {str(path)!r} is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    except OSError as err:
        raise LabError(f"{what}: cannot read {str(path)!r} ({err.strerror}); check that it is readable") from None


def read_notebook(path: PathLike, what: str):
    """A Jupyter notebook (nbformat 4 node); a file that is not JSON or not a valid notebook is one LabError."""
    import json

    import nbformat

    text = read_text(path, what, missing="give the path of a Jupyter notebook (.ipynb)")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise LabError(
            f"{what}: {str(path)!r} is not JSON ({err.msg}, line {err.lineno}); give a Jupyter notebook (.ipynb)"
        ) from None
    if not isinstance(data, dict) or "nbformat" not in data or not isinstance(data.get("cells"), list):
        raise LabError(
            f"{what}: {str(path)!r} is JSON but not a Jupyter notebook (no 'nbformat' and 'cells'); "
            "give a Jupyter notebook (.ipynb)"
        )
    try:
        nb = nbformat.reads(text, as_version=4)
        nbformat.validate(nb)
    except (ValueError, TypeError, KeyError, AttributeError, nbformat.ValidationError) as err:
        # why this many: nbformat's reader and converters raise each of them for malformed content
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise LabError(
            f"{what}: {str(path)!r} is not a valid notebook ({reason[:200]}); open and save it in Jupyter to repair it"
        ) from None
    return nb
