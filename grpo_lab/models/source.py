"""Where a model's files come from: a checkpoint directory, a hub id, or a built-in tiny model (`builtin:NAME`, built
into the user cache on first use by tiny.py). The learner, the generators, the planner and a sharded driver all
resolve a model's name here."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import LabError

BUILTIN = "builtin:"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_path(name_or_path: str) -> str:
    """`builtin:tiny-qwen2` -> its directory in the user cache, built on first use; anything else as given."""
    if not name_or_path.startswith(BUILTIN):
        return name_or_path
    from .tiny import BUILTINS, builtin_path, ensure_tiny_model

    name = name_or_path.removeprefix(BUILTIN)
    if name not in BUILTINS:
        raise LabError(
            f"model.name_or_path: unknown built-in model {name_or_path!r}; use one of {[BUILTIN + n for n in BUILTINS]}"
        )
    return str(ensure_tiny_model(builtin_path(name), **BUILTINS[name][1]))


def check_model_path(name_or_path: str) -> str:
    """A local directory must hold config.json; anything else must look like a hub id. Returns what to load:
    a built-in model is built here and its directory returned."""
    name_or_path = resolve_model_path(name_or_path)
    path = Path(name_or_path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LabError(
                f"model.name_or_path: {name_or_path!r} has no config.json; point it at a checkpoint directory"
            )
        return name_or_path
    if path.exists() or not _HUB_ID.match(name_or_path) or name_or_path.startswith("."):
        raise LabError(
            f"model.name_or_path: {name_or_path!r} does not exist; build the tiny model with "
            f"`grpo-lab tiny {name_or_path}` or give a checkpoint directory"
        )
    return name_or_path


def fetch_once(name_or_path: str, local: bool) -> str:
    """The model's files fetched by the driver, with its progress bar, before any rank starts: a built-in model built,
    a hub id downloaded (once, not once per rank, and outside the ranks' start timeout). Ranks on this machine then
    load the local copy; on a cluster (`local` false) a hub id stays one, fetched by each machine's ranks."""
    if name_or_path.startswith(BUILTIN):
        return resolve_model_path(name_or_path) if local else name_or_path  # each machine builds the same one
    if Path(name_or_path).exists():
        return name_or_path
    from huggingface_hub import snapshot_download

    path = snapshot_download(name_or_path)
    return path if local else name_or_path
