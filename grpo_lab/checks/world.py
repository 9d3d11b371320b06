"""Checks of a sharded learner's world before any process starts (pure: they read the config and what is
installed). Which rank this process is, and the collectives, are the runtime's (grpo_lab/runtime.py)."""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..errors import LabError
from ..runtime import rank_devices


# --- checks before any process starts (pure: they read the config and what is installed) ---

def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def backend_for(learner: str) -> str:
    """The process-group backend of a learner's device type."""
    return "gloo" if learner == "cpu" else "nccl"


def check_engine(learner: str) -> None:
    """FSDP2 and the process-group backend must be in this torch."""
    try:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as err:
        raise LabError(f"placement.learner_procs: sharding needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6), "
                       f"which this torch {torch.__version__} does not have ({err}); install the locked torch "
                       "(README 'Install') or set placement.learner_procs: 1") from None
    backend = backend_for(learner)
    available = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available}[backend]
    if not dist.is_available() or not available():
        raise LabError(f"placement.learner_procs: ranks on {learner} talk over {backend}, which this torch "
                       f"{torch.__version__} was built without; install a torch with it or set placement.learner_procs: 1")


def check_ranks(config, cuda_count: Optional[int] = None, cpus: Optional[int] = None) -> None:
    """More ranks than devices, or an engine that is not installed: one line, before any process starts."""
    place = config.placement
    procs = place.learner_procs
    if procs == 1:
        return
    check_engine(place.learner)
    from ..cluster.ray_cluster import import_ray_for

    import_ray_for(place.ray_address)   # Ray installed, or one line naming the extra
    if place.ray_address is not None:
        from ..cluster.ray_cluster import check_reachable

        check_reachable(place.ray_address)   # before anything loads: an unreachable address is one line in seconds
        return   # the cluster's resources decide, checked when it is joined, before any rank starts (cluster/ray_cluster.py)
    if place.learner == "cpu":
        cpus = usable_cpus() if cpus is None else cpus
        if procs > cpus:
            raise LabError(f"placement.learner_procs: {procs} CPU ranks on {cpus} usable CPU core(s); every rank needs a "
                           f"core of its own (gloo ranks that share one wait on each other); use at most {cpus}")
        return
    if cuda_count is None:
        from .devices import cuda_device_count

        cuda_count = cuda_device_count()
    devices = rank_devices(place.learner, procs)
    if int(devices[-1].split(":")[1]) >= cuda_count:
        first = int(place.learner.split(":")[1])
        raise LabError(f"placement.learner_procs: {procs} ranks from {place.learner} need {devices[0]}..{devices[-1]}, "
                       f"but this machine has {cuda_count} CUDA device(s); use at most {max(cuda_count - first, 0)} ranks "
                       "from there, or another placement.learner")
