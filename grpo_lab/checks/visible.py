"""Which GPUs the generator engine sees, and in which process it runs, from the placement alone (pure: no
torch, no CUDA). Placement devices ('cuda:1') are indices into what this process sees, i.e. into the
user's CUDA_VISIBLE_DEVICES when exported; the engine gets the physical ids (or UUIDs) they stand for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ..errors import LabError

_ENTRY = re.compile(r"^(\d+|GPU-[\w-]+|MIG-[\w/-]+)$")  # what CUDA accepts in CUDA_VISIBLE_DEVICES


@dataclass(frozen=True)
class EngineDevices:
    cuda_visible_devices: Optional[str]  # the engine's CUDA_VISIBLE_DEVICES; None = none set (in-process)
    own_process: bool  # VLLM_ENABLE_V1_MULTIPROCESSING=1: the engine runs in a process of its own
    learner: str  # the learner's torch device in this process (never remapped)


def visible_ids(user_cvd: Optional[str]) -> Optional[list[str]]:
    """The user's CUDA_VISIBLE_DEVICES as a list (None = not exported: every GPU, index = physical id).
    CUDA stops at the first entry it cannot read (a '-1' hides the rest), and so does this."""
    if user_cvd is None:
        return None
    ids = []
    for entry in user_cvd.split(","):
        if not _ENTRY.match(entry.strip()):
            break
        ids.append(entry.strip())
    return ids


def physical_id(device: str, field: str, visible: Optional[list[str]]) -> str:
    """'cuda:N' -> the id the GPU has outside this process (N itself when nothing is exported)."""
    index = int(device.split(":")[1])
    if visible is None:
        return str(index)
    if index >= len(visible):
        seen = "no GPU" if not visible else f"{len(visible)} GPU(s), cuda:0..cuda:{len(visible) - 1}"
        raise LabError(
            f"{field}: {device!r} is beyond CUDA_VISIBLE_DEVICES={','.join(visible)!r}, which makes {seen} "
            f"visible here; use one of those, or export a CUDA_VISIBLE_DEVICES that lists the GPU"
        )
    return visible[index]


def engine_devices(learner: str, generator: list[str], user_cvd: Optional[str]) -> EngineDevices:
    """Where the vLLM engine must run so that it lands on exactly the generator devices, or a LabError naming
    the placement field that cannot be honoured.

    In-process only where it lands right by itself: on the CPU, or as one engine on this process's first
    visible GPU (an in-process engine takes cuda:0 of what the process sees, and CUDA_VISIBLE_DEVICES cannot
    be changed under a process that may have initialised CUDA, nor without remapping the learner's indices).
    Anything else (another GPU, tensor parallel) gets its own process, pinned by CUDA_VISIBLE_DEVICES."""
    visible = visible_ids(user_cvd)
    if learner != "cpu":
        physical_id(learner, "placement.learner", visible)
    if len(set(generator)) != len(generator):
        twice = next(d for d in generator if generator.count(d) > 1)
        raise LabError(f"placement.generator: {twice!r} is listed twice; list each device once")
    if "cpu" in generator:
        if generator != ["cpu"]:
            raise LabError(
                f"placement.generator: {generator} mixes 'cpu' with GPUs; one engine runs on the CPU or "
                "on GPUs, not both: give ['cpu'] or GPUs only"
            )
        return EngineDevices(None, own_process=False, learner=learner)
    physical = [physical_id(d, "placement.generator", visible) for d in generator]
    if len(set(physical)) != len(physical):
        raise LabError(
            f"placement.generator: {generator} name the same GPU twice through CUDA_VISIBLE_DEVICES="
            f"{user_cvd!r}; list each GPU once (and each once in CUDA_VISIBLE_DEVICES)"
        )
    in_process = generator == ["cuda:0"]
    return EngineDevices(None if in_process else ",".join(physical), own_process=not in_process, learner=learner)
