"""The plan of a learner sharded with FSDP2 over `placement.learner_procs` ranks (P3): every rank's items come from
the one builder the one-process plan uses (learner_items.add_learner, with `procs`), and this module places them: a
device per CUDA rank, or, for CPU ranks, which share host RAM, the host as the sum of every rank's process; the
driver's own process; one vLLM engine for every rank, in the driver. A rank budget (placement.rank_memory_gib) is
each rank's capacity: a CPU rank is then a device of the plan too, checked against its own line.
"""

from __future__ import annotations

from ..models.shapes import ModelShape
from .estimate import (
    HOST_BASELINE,
    PHASES,
    RAY_PROCESSES,
    DevicePlan,
    GiB,
    planned_lora,
    rollout_sequences,
)
from .kernel_share import add_kernel_items
from .learner_items import add_learner
from .parts import _home, add_engine, capacity_of, line_of
from .reward_items import add_reward_models


def rank_name(learner: str, device: str, k: int) -> str:
    """A rank's row: its GPU, or its share of host RAM ('host (rank k)') for a CPU learner."""
    return f"host (rank {k})" if learner == "cpu" else device


def rank_capacity(config, device: str, host_capacity: float) -> float:
    """What rank `device` may hold: its share of host RAM (a CPU rank) or its GPU, at most placement.rank_memory_gib
    (the budget its own guard, or its capped allocator, holds it to)."""
    own = host_capacity if device == "cpu" else capacity_of(device, config)
    budget = config.placement.rank_memory_gib
    return own if budget is None else min(own, budget * GiB)


def ray_line_role(machine: float) -> list[str]:
    """What the Ray the ranks start on kills at (P4): its memory monitor, above a share of this machine's memory."""
    from ..checks.world import ray_kill_share

    share = ray_kill_share()
    if share is None:
        return []
    return [
        f"Ray's memory monitor kills a rank when this machine's used RAM passes {share:g} of it "
        f"({share * machine / GiB:.1f} GiB; RAY_memory_usage_threshold): hold the ranks under it with "
        "placement.rank_memory_gib"
    ]


def build_sharded(config, shape: ModelShape) -> tuple[dict[str, DevicePlan], dict[str, DevicePlan], int]:
    """(devices, ranks, micro-batch): every device's plan (CUDA: one per rank plus the host; CPU: the host, the sum
    of every rank's process) and every rank's own plan (CUDA: the rank's device; CPU: its share of host RAM)."""
    from ..runtime import rank_devices

    place, procs = config.placement, config.placement.learner_procs
    on_cpu = place.learner == "cpu"
    host = DevicePlan("host", capacity_of("host", config), line=line_of("host", config))
    if on_cpu:
        host.roles.append(f"{procs} learner ranks, a process each (their sum)")
        if place.ray_address is None:
            host.roles += ray_line_role(host.capacity)
    host.add(
        "driver process (the Lab)",
        HOST_BASELINE["cpu" if on_cpu else "cuda"],
        "the notebook or grpo-lab run: drives the ranks"
        + (
            f", runs their {config.generator.backend} engine (below)"
            if config.generator.own_weights
            else ", holds no model of the learner's"
        ),
    )
    add_kernel_items(host)  # why: a notebook driving the ranks holds IPython and its figures beside the lab
    if place.ray_address is None:  # why: a local Ray's own processes live in this machine's RAM beside the ranks
        host.add("Ray's own processes", RAY_PROCESSES, "GCS, raylet, agents, idle workers: a local Ray, measured")
    lora = planned_lora(shape, config)
    ranks, micro = {}, 0
    for k, device in enumerate(rank_devices(place.learner, procs)):
        name = rank_name(place.learner, device, k)
        rank = DevicePlan(name, rank_capacity(config, device, host.capacity), line=line_of(name, config))
        rank.roles.append(f"learner rank {k} of {procs} (FSDP2)")
        if place.rank_memory_gib is not None:
            rank.roles.append("its own budget: placement.rank_memory_gib")
        micro = add_learner(rank, host, rank, config, shape, procs)
        ranks[name] = rank
        if on_cpu:  # why the sum: every rank is its own process in the same host RAM, all in the same phase at once
            host.add(f"rank {k}", rank.resident, "its process: runtime, shards, rollback copy (rank block above)")
            for phase in PHASES:
                host.add(f"rank {k}", rank.phase_peak(phase) - rank.resident, phase=phase)
        else:
            rollback = lora * 12 / procs
            host.add(
                f"rank {k} process",
                HOST_BASELINE["cuda"] + rollback,
                f"Python, torch, libraries + step rollback copy of its shard ({rollback / 1024**2:.1f} MiB)",
            )
    # why a budgeted CPU rank is a device: its own line is checked (and shown) beside the host that adds them up
    devices = {"host": host} if on_cpu and place.rank_memory_gib is None else {**ranks, "host": host}
    if config.generator.own_weights:  # one engine for every rank, in the driver (on its own GPUs, or the host)
        for d in dict.fromkeys(_home(d) for d in place.generator_devices()):
            if d not in devices:
                devices[d] = DevicePlan(d, capacity_of(d, config))
                devices[d].add_cuda_runtime()
        add_engine(devices, config, shape, rollout_sequences(config))
    add_reward_models(devices, config)  # in the driver, which scores every rollout once (execution/sharded/driver.py)
    return devices, ranks, micro


def rank_lines(plan) -> dict[str, dict]:
    """Each rank's planned peak against its capacity (placement.rank_memory_gib, when set) and its line (a CPU rank's
    guard stops it at memory.host_threshold of it), in MiB: {rank: {peak_mib, phase, capacity_mib, line_mib, fits}}:
    what a notebook quotes of a sharded plan."""
    MiB = 1024**2
    return {
        name: {
            "peak_mib": d.total / MiB,
            "phase": d.peak_phase,
            "capacity_mib": d.capacity / MiB,
            "line_mib": d.line_bytes / MiB,
            "fits": d.fits,
        }
        for name, d in plan.ranks.items()
    }
