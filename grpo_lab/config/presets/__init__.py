"""Preset configs shipped inside the package, addressed by name anywhere a config path is accepted
(`grpo-lab run tiny-cpu`, `Lab("tiny-cpu")`). Each YAML file's first comment line is
`# NAME: what it is for`; `grpo-lab presets` lists them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent


def preset_names() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.yaml"))


def preset_path(name: str) -> Optional[Path]:
    """The YAML file of preset `name` (with or without `.yaml`), or None if there is no such preset."""
    stem = name.removesuffix(".yaml")
    if "/" in stem or stem != Path(stem).name:
        return None
    path = HERE / f"{stem}.yaml"
    return path if path.is_file() else None


def describe(name: str) -> str:
    """The one-line description from the preset's first comment line."""
    first = preset_path(name).read_text().splitlines()[0]
    return first.lstrip("# ").removeprefix(f"{name}:").strip()


def listing() -> str:
    width = max(len(n) for n in preset_names())
    return "\n".join(f"{name:<{width}}  {describe(name)}" for name in preset_names())
