"""The config.json copies bundled in models/configs/: real models' shapes, for planning before a download and for the
built-in random-weight shapes (random_shapes.py)."""

from __future__ import annotations

from pathlib import Path

BUNDLED = Path(__file__).parent / "configs"


def bundled_name(model_id: str) -> str:
    return model_id.replace("/", "--")
