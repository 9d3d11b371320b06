"""This process's place in a sharded learner: its rank, the world size, which rows of a step's batch are its
own, and the collectives a step needs (sums of loss statistics, gathering per-row results). A process that is
not a rank is a world of one, where every collective is the identity, so the step's code is the same either way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import LabError


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def rows(self, n: int) -> slice:
        """This rank's rows of an n-row batch: a contiguous 1/size of it (the config makes n divisible)."""
        share = n // self.size
        return slice(self.rank * share, (self.rank + 1) * share)

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over the ranks (every rank gets it)."""
        if not self.sharded:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
        dist.all_reduce(t)
        return t.tolist()

    def gather_rows(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's rows (its `rows(n)` slice of a per-row tensor) concatenated in rank order, on every rank."""
        if not self.sharded:
            return part
        import torch.distributed as dist

        device = _comm_device()
        parts = [torch.empty_like(part, device=device) for _ in range(self.size)]
        dist.all_gather(parts, part.to(device).contiguous())
        return torch.cat(parts).to(part.device)


def _comm_device() -> torch.device:
    """Where a collective's tensors must be: the rank's GPU under NCCL, the CPU under gloo."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


_WORLD = World()


def world() -> World:
    """This process's world (set once by a rank's worker; a world of one everywhere else)."""
    return _WORLD


def set_world(value: World) -> None:
    global _WORLD
    _WORLD = value


# --- checks before any process starts (pure: they read the config and what is installed) ---

def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def rank_devices(learner: str, procs: int) -> list[str]:
    """Rank k's device: cuda:(N+k) for a learner on cuda:N; 'cpu' for every rank of a CPU learner."""
    if learner == "cpu":
        return ["cpu"] * procs
    first = int(learner.split(":")[1])
    return [f"cuda:{first + k}" for k in range(procs)]


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
    if place.learner == "cpu":
        cpus = usable_cpus() if cpus is None else cpus
        if procs > cpus:
            raise LabError(f"placement.learner_procs: {procs} CPU ranks on {cpus} usable CPU core(s); every rank needs a "
                           f"core of its own (gloo ranks that share one wait on each other); use at most {cpus}")
        return
    if cuda_count is None:
        from ..devices import cuda_device_count

        cuda_count = cuda_device_count()
    devices = rank_devices(place.learner, procs)
    if int(devices[-1].split(":")[1]) >= cuda_count:
        first = int(place.learner.split(":")[1])
        raise LabError(f"placement.learner_procs: {procs} ranks from {place.learner} need {devices[0]}..{devices[-1]}, "
                       f"but this machine has {cuda_count} CUDA device(s); use at most {max(cuda_count - first, 0)} ranks "
                       "from there, or another placement.learner")
