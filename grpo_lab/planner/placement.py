"""`lab.placement`: who sits where, printed as the device plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config.schema import LabConfig


class Placement:
    """Who sits where; prints as the device plan."""

    def __init__(self, config: LabConfig, generator=None):
        """`generator`: the loaded generator, whose engine's share is shown (before load: the share it will take)."""
        self.config, self.generator = config, generator

    def share(self) -> str:
        """vLLM's gpu_memory_utilization on its GPUs: the loaded engine's, else the number set, or auto's plan."""
        from ..errors import LabError
        from . import engine_share

        chosen = self.config.generator.gpu_memory_utilization
        loaded = getattr(self.generator, "gpu_memory_utilization", None)
        try:
            share = loaded if loaded is not None else engine_share(self.config)
        except LabError:
            return "gpu_memory_utilization auto: no share fits, see lab.plan()"
        return f"gpu_memory_utilization {share:.2f}" + (" (auto)" if chosen == "auto" else "")

    def roles(self) -> dict[str, list[str]]:
        config, place = self.config, self.config.placement
        out: dict[str, list[str]] = {}
        learner = "learner (4-bit base + LoRA" + (
            ", AdamW state in host RAM)" if place.optimizer_offload else " + AdamW)"
        )
        out.setdefault(place.learner, []).append(learner)
        engine = config.generator.own_weights and any(d != "cpu" for d in place.generator_devices())
        for device in place.generator_devices():
            shared = " colocated" if device == place.learner else ""
            share = f", {self.share()}" if engine and device != "cpu" else ""
            out.setdefault(device, []).append(f"generator ({config.generator.backend}{shared}{share})")
        if config.reference_strategy == "copy":
            out.setdefault(config.reference_device, []).append("reference (frozen copy)")
        elif config.reference_strategy == "adapter-disabled":
            out[place.learner].append("reference (adapter disabled, no copy)")
        for name in config.data.reward_models:
            nf4 = ", nf4" if place.reward_model_4bit else ""
            out.setdefault(place.reward_model_device(), []).append(f"reward model ({name}{nf4})")
        return out

    @property
    def mode(self) -> str:
        place = self.config.placement
        return "colocated" if place.learner in place.generator_devices() else "split"

    def __repr__(self) -> str:
        lines = [f"placement ({self.mode}):"]
        lines += [f"  {device:<8} {', '.join(roles)}" for device, roles in self.roles().items()]
        return "\n".join(lines)


def place(lab, learner=None, generator=None, reference=None, optimizer_offload=None) -> Placement:
    """`lab.place(...)`: the Lab's config with these devices, validated at once, before load."""
    from ..checks.devices import check_devices
    from ..config.loading import load_config
    from ..errors import LabError

    if lab.learner is not None:
        raise LabError("lab.place(): the models are loaded already; call it before lab.load() (or in a new Lab)")
    data = lab.config.to_dict()
    if learner is not None:
        data["placement"]["learner"] = learner
    if generator is not None:
        data["placement"]["generator"] = generator if isinstance(generator, (list, tuple)) else [generator]
    if reference is not None:
        data["reference"].update({"strategy": "copy", "device": reference})
    if optimizer_offload is not None:
        data["placement"]["optimizer_offload"] = optimizer_offload
    config = load_config(data)
    check_devices(config)
    lab.config = config
    return lab.placement
