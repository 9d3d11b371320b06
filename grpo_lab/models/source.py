"""Where a model's files come from: a checkpoint directory, a hub id, or a built-in tiny model (`builtin:NAME`, built
into the user cache on first use by tiny.py). The learner, the generators, the planner and a sharded driver all
resolve a model's name here."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import LabError

BUILTIN = "builtin:"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_path(name_or_path: str, field: str = "model.name_or_path") -> str:
    """`builtin:tiny-qwen2` -> its directory in the user cache, built on first use; a random-weight real shape
    (`builtin:qwen3-8b-random`, models/random_shapes.py) has no files and stays its name; anything else as given."""
    if not name_or_path.startswith(BUILTIN):
        return name_or_path
    from .random_shapes import RANDOM_SHAPES, parse_random
    from .tiny import BUILTINS, builtin_path, ensure_tiny_model

    if parse_random(name_or_path) is not None:
        return name_or_path
    name = name_or_path.removeprefix(BUILTIN)
    if name not in BUILTINS:
        known = [BUILTIN + n for n in [*BUILTINS, *RANDOM_SHAPES]]
        raise LabError(f"{field}: unknown built-in model {name_or_path!r}; use one of {known}")
    return str(ensure_tiny_model(builtin_path(name), **BUILTINS[name][1]))


def check_model_path(name_or_path: str, field: str = "model.name_or_path") -> str:
    """A local directory must hold config.json; anything else must look like a hub id. Returns what to load:
    a built-in model is built here and its directory returned. Errors name `field`."""
    from .random_shapes import parse_random

    name_or_path = resolve_model_path(name_or_path, field)
    if parse_random(name_or_path) is not None:
        return name_or_path  # built in memory at load (models/random_shapes.py)
    path = Path(name_or_path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LabError(f"{field}: {name_or_path!r} has no config.json; point it at a checkpoint directory")
        return name_or_path
    if path.exists() or not _HUB_ID.match(name_or_path) or name_or_path.startswith("."):
        fix = (
            f"build the tiny model with `grpo-lab tiny {name_or_path}` or give a checkpoint directory"
            if field == "model.name_or_path"
            else "give a checkpoint directory, a hub id or a builtin: name"
        )
        raise LabError(f"{field}: {name_or_path!r} does not exist; {fix}")
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


def require_files(name_or_path: str, who: str) -> None:
    """A built-in random-weight shape lives in memory only: `who` (vLLM's engine, a sharded rank's reader) needs
    checkpoint files, so it is refused in one line."""
    from .random_shapes import parse_random

    if parse_random(name_or_path) is not None:
        raise LabError(
            f"model.name_or_path: {name_or_path!r} is built in memory and has no checkpoint files, which {who} "
            "needs; use generator.backend hf or synthetic and one learner process, or a checkpoint directory"
        )
