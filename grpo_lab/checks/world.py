"""Checks of a sharded learner's world before any process starts (pure: they read the config and what is
installed, and ask a Ray address whether it answers). Which rank this process is, and the collectives, are the
runtime's (grpo_lab/runtime.py); starting the ranks is the Ray driver's (execution/sharded/)."""

from __future__ import annotations

import os
import socket
import sys
from typing import Optional

import torch

from ..errors import LabError
from ..runtime import rank_devices
from .roles import parse_address

CONNECT_S = 5  # an address that does not answer a TCP connect within this is unreachable
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": a local Ray binds 127.0.0.1 only (read at `import ray`)
# Ray's memory monitor (P4): a Ray started here reads these at its start; above the share of the machine's memory it
# kills a worker, polling every refresh_ms (0: the monitor is off)
RAY_THRESHOLD_ENV, RAY_MONITOR_ENV = "RAY_memory_usage_threshold", "RAY_memory_monitor_refresh_ms"
RAY_DEFAULT_THRESHOLD = 0.95  # Ray's own default (its ray_config_def.h)


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
        raise LabError(
            f"placement.learner_procs: sharding needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6), "
            f"which this torch {torch.__version__} does not have ({err}); install the locked torch "
            "(README 'Install') or set placement.learner_procs: 1"
        ) from None
    backend = backend_for(learner)
    available = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available}[backend]
    if not dist.is_available() or not available():
        raise LabError(
            f"placement.learner_procs: ranks on {learner} talk over {backend}, which this torch "
            f"{torch.__version__} was built without; install a torch with it or set placement.learner_procs: 1"
        )


def check_ranks(config, cuda_count: Optional[int] = None, cpus: Optional[int] = None) -> None:
    """More ranks than devices, or an engine that is not installed: one line, before any process starts."""
    place = config.placement
    procs = place.learner_procs
    if procs == 1:
        return
    check_engine(place.learner)
    import_ray_for(place.ray_address)  # Ray installed, or one line naming the extra
    if place.ray_address is not None:
        check_reachable(place.ray_address)  # before anything loads: an unreachable address is one line in seconds
        # the cluster's resources decide, checked when it is joined, before any rank starts (sharded/ray_cluster.py)
        return
    if place.learner == "cpu":
        cpus = usable_cpus() if cpus is None else cpus
        if procs > cpus:
            raise LabError(
                f"placement.learner_procs: {procs} CPU ranks on {cpus} usable CPU core(s); every rank needs a "
                f"core of its own (gloo ranks that share one wait on each other); use at most {cpus}"
            )
        return
    if cuda_count is None:
        from .devices import cuda_device_count

        cuda_count = cuda_device_count()
    devices = rank_devices(place.learner, procs)
    if int(devices[-1].split(":")[1]) >= cuda_count:
        first = int(place.learner.split(":")[1])
        raise LabError(
            f"placement.learner_procs: {procs} ranks from {place.learner} need {devices[0]}..{devices[-1]}, "
            f"but this machine has {cuda_count} CUDA device(s); use at most {max(cuda_count - first, 0)} ranks "
            "from there, or another placement.learner"
        )


def ray_kill_share() -> Optional[float]:
    """The share of this machine's memory above which the memory monitor of a Ray started here kills a worker
    (RAY_memory_usage_threshold, else Ray's default 0.95); None when the monitor is off. A share Ray cannot start
    with is one line: Ray itself only times out ("the current node timed out during startup")."""
    if os.environ.get(RAY_MONITOR_ENV, "").strip() == "0":
        return None
    raw = os.environ.get(RAY_THRESHOLD_ENV)
    if raw is None:
        return RAY_DEFAULT_THRESHOLD
    try:
        share = float(raw)
    except ValueError:
        share = float("nan")
    if not 0 < share <= 1:
        raise LabError(
            f"{RAY_THRESHOLD_ENV}={raw!r}: the share of this machine's memory above which Ray's memory monitor kills "
            "a worker must be in (0, 1], and a Ray started with this one does not start; unset it (Ray's default "
            f"{RAY_DEFAULT_THRESHOLD}) or give a share such as 0.9"
        )
    return share


def import_ray():
    """Ray, or one line naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise LabError(
            "placement.learner_procs: a sharded learner's ranks run as Ray actors, and Ray is not installed; "
            "pip install 'grpo-lab[ray]' (or set placement.learner_procs: 1)"
        ) from None
    return ray


def import_ray_for(address: Optional[str]):
    """Ray, imported so that a local one (no address) binds loopback only."""
    if address is None and "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_ENV, "0")  # why: a Ray only this machine uses binds no public address
    return import_ray()


def check_reachable(address: str, timeout: float = CONNECT_S) -> None:
    """One line within `timeout` when nothing listens at `address` (ray.init would retry for minutes)."""
    if address == "auto":
        return
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as err:
        raise LabError(
            f"placement.ray_address: no Ray cluster answers at {address} ({err.strerror or err}); start one "
            f"there with `ray start --head --port {port}`, or set placement.ray_address: null for a local "
            "Ray"
        ) from None
