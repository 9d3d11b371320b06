"""`lab.placement`: who sits where, printed as the device plan."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import LabConfig


class Placement:
    """Who sits where; prints as the device plan."""

    def __init__(self, config: LabConfig):
        self.config = config

    def roles(self) -> dict[str, list[str]]:
        cfg, place = self.config, self.config.placement
        out: dict[str, list[str]] = {}
        learner = "learner (4-bit base + LoRA" + (", AdamW state in host RAM)" if place.optimizer_offload else " + AdamW)")
        out.setdefault(place.learner, []).append(learner)
        for device in place.generator_devices():
            shared = " colocated" if device == place.learner else ""
            out.setdefault(device, []).append(f"generator ({cfg.generator.backend}{shared})")
        if cfg.reference_strategy == "copy":
            out.setdefault(cfg.reference_device, []).append("reference (frozen copy)")
        elif cfg.reference_strategy == "adapter-disabled":
            out[place.learner].append("reference (adapter disabled, no copy)")
        return out

    @property
    def mode(self) -> str:
        place = self.config.placement
        return "colocated" if place.learner in place.generator_devices() else "split"

    def __repr__(self) -> str:
        lines = [f"placement ({self.mode}):"]
        lines += [f"  {device:<8} {', '.join(roles)}" for device, roles in self.roles().items()]
        return "\n".join(lines)
