"""Checks that run before anything is loaded: devices exist, paths exist. Never creates a
CUDA context (torch.cuda.device_count() reads NVML)."""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import LabError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_device(device: str, field: str) -> None:
    if device == "cpu":
        return
    index = int(device.split(":")[1])
    count = cuda_device_count()
    if index >= count:
        have = "no CUDA devices" if count == 0 else f"CUDA devices 0..{count - 1}"
        raise LabError(f"{field}: device {device!r} does not exist (this machine has {have}); "
                       f"use 'cpu'{'' if count == 0 else ' or cuda:0..' + str(count - 1)}")


def check_model_path(name_or_path: str) -> str:
    """A local directory must hold config.json; anything else must look like a hub id. Returns what to load:
    a built-in model is built here and its directory returned."""
    from ..models.tiny import resolve_model_path

    name_or_path = resolve_model_path(name_or_path)
    path = Path(name_or_path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LabError(f"model.name_or_path: {name_or_path!r} has no config.json; point it at a checkpoint directory")
        return name_or_path
    if path.exists() or not _HUB_ID.match(name_or_path) or name_or_path.startswith("."):
        raise LabError(f"model.name_or_path: {name_or_path!r} does not exist; build the tiny model with "
                       f"`grpo-lab tiny {name_or_path}` or give a checkpoint directory")
    return name_or_path


def check_placement(config) -> None:
    """Every device the config names exists here, and the generator engine can be put on exactly its devices."""
    from ..generation.registry import OWN_WEIGHTS
    from .visible import engine_devices

    place = config.placement
    # a backend without its own weights has no engine: its generator devices are check_hf_placement's to judge
    generator = place.generator_devices() if config.generator.backend in OWN_WEIGHTS else [place.learner]
    engine_devices(place.learner, generator, os.environ.get("CUDA_VISIBLE_DEVICES"))
    check_device(place.learner, "placement.learner")
    for dev in place.generator_devices():
        check_device(dev, "placement.generator")
    if config.reference.device:
        check_device(config.reference.device, "reference.device")


def ensure_on_device(model, device, field: str) -> None:
    """Every parameter of `model` is on `device`; a model that landed elsewhere (e.g. offloaded by
    a device map) is refused here with the fix, not by a device-mismatch error in a forward pass."""
    import torch

    device = torch.device(device)
    stray = {str(p.device) for p in model.parameters() if p.device.type != device.type
             or (device.index is not None and p.device.index != device.index)}
    if stray:
        raise LabError(f"{field}: model parameters are on {sorted(stray)}, not {device}; "
                       "free memory on that device or choose another one")
