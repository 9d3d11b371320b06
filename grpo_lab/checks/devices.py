"""Checks that run before anything is loaded: the devices a config names exist here. Never creates a
CUDA context (torch.cuda.device_count() reads NVML)."""

from __future__ import annotations

import os

from ..errors import LabError


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
        raise LabError(
            f"{field}: device {device!r} does not exist (this machine has {have}); "
            f"use 'cpu'{'' if count == 0 else ' or cuda:0..' + str(count - 1)}"
        )


def check_devices(config) -> None:
    """Every device the config names exists here, and the generator engine can be put on exactly its devices."""
    from .visible import engine_devices

    place = config.placement
    # a backend without its own weights has no engine: its generator devices are check_hf_placement's to judge
    generator = place.generator_devices() if config.generator.own_weights else [place.learner]
    engine_devices(place.learner, generator, os.environ.get("CUDA_VISIBLE_DEVICES"))
    check_device(place.learner, "placement.learner")
    for dev in place.generator_devices():
        check_device(dev, "placement.generator")
    if config.reference.device:
        check_device(config.reference.device, "reference.device")
    if config.placement.reward_model:
        check_device(config.placement.reward_model, "placement.reward_model")


def ensure_on_device(model, device, field: str) -> None:
    """Every parameter of `model` is on `device`; a model that landed elsewhere (e.g. offloaded by
    a device map) is refused here with the fix, not by a device-mismatch error in a forward pass."""
    import torch

    device = torch.device(device)
    stray = {
        str(p.device)
        for p in model.parameters()
        if p.device.type != device.type or (device.index is not None and p.device.index != device.index)
    }
    if stray:
        raise LabError(
            f"{field}: model parameters are on {sorted(stray)}, not {device}; "
            "free memory on that device or choose another one"
        )
