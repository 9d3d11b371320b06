"""Config in and out: a LabConfig from a YAML file, a preset name, a dict or another LabConfig (with `--set`
overrides), and back to YAML, atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import yaml

from ..checks.paths import read_text
from ..errors import ConfigError
from .fields import apply_overrides
from .schema import LabConfig, parse_config


def config_source(source: Union[str, Path]) -> Path:
    """The YAML file behind a path or a preset name (an existing file wins over a preset of the same name)."""
    from .presets import preset_names, preset_path

    path = Path(source)
    if path.is_file():
        return path
    preset = preset_path(str(source))
    if preset is not None:
        return preset
    raise ConfigError(
        f"config {str(source)!r} is neither a YAML file nor a preset; presets: {', '.join(preset_names())} "
        "(`grpo-lab presets` describes them)"
    )


def load_config(source: Union[str, Path, dict, LabConfig], overrides: Optional[list[str]] = None) -> LabConfig:
    """A LabConfig from a YAML path, a preset name, a dict or a LabConfig, with optional 'a.b=c' overrides."""
    if isinstance(source, LabConfig):
        data = source.to_dict()
    elif isinstance(source, dict):
        data = source
    else:
        path = config_source(source)
        try:
            data = yaml.safe_load(read_text(path, "config")) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    return parse_config(apply_overrides(data, overrides or []))


def save_config(config: LabConfig, path: Union[str, Path]) -> Path:
    """Write the resolved config as YAML, atomically (a reader never sees half a file)."""
    from ..files import atomic_write_text

    return atomic_write_text(path, yaml.safe_dump(config.to_dict(), sort_keys=False))
