"""Each rank's own memory budget (placement.rank_memory_gib), held by the rank itself: a CPU rank's sampler guards its
process's RSS against the budget (`RankGuard`), a GPU rank's CUDA allocator is capped at it (`cap_rank_gpu`).

Where it departs from the one-process guard: a rank may not stop alone (the others would wait for it in a
collective), so its guard's word, at a phase's start and at its end, is agreed by every rank (runtime.agree): a phase
one rank's guard fails fails on every rank, each undoes it, and the driver reports the rank that crossed. While a
phase's work runs, the rank's live guard (memory/live_guard.py) stops it where its RSS crosses the line, so the rank
stops before Ray's memory monitor (whose line the budgets sit under, preflight.check_ray_line) kills it: the others
learn it at their next decision (the phase's end: they undo it too), or, blocked in a collective it left, are
restarted by the driver from the step's start (runtime.agree's RanksBlocked).
"""

from __future__ import annotations

from typing import Optional

from ...memory.sampler import HostMemoryExceeded, MemorySampler

GiB = 1024**3


def rank_budget(config) -> Optional[float]:
    """placement.rank_memory_gib in bytes (None: unset)."""
    gib = config.placement.rank_memory_gib
    return gib * GiB if gib else None


def rank_sampler(config, devices: list[str], describe_offload) -> MemorySampler:
    """A rank's memory sampler: a CPU rank with a budget guards its own RSS against it (RankGuard); otherwise the
    rank guards nothing (its GPU is capped at load, cap_rank_gpu; the driver guards the machine's RAM)."""
    budget = rank_budget(config) if config.placement.learner == "cpu" else None
    kind = RankGuard if budget else MemorySampler
    return kind(
        devices,
        config.memory.sample_hz,
        config.memory.host_threshold,
        describe_offload=describe_offload,
        guard_host=budget is not None,
        host_budget=budget,
        live=True,  # why: stop the phase at the line, before Ray's monitor kills the process (the module docstring)
    )


class RankGuard(MemorySampler):
    """A CPU rank's sampler whose host guard holds this rank's process to placement.rank_memory_gib, every rank
    taking the same branch on its word (see the module docstring)."""

    def check_host(self, step: int, phase: str) -> None:
        try:
            super().check_host(step, phase)
            mine = None
        except HostMemoryExceeded as err:
            mine = err
        agreed = self._agreed(phase, mine)
        if agreed is not None:
            raise agreed

    def veto(self, record, peak: dict, end: dict):
        # (called only when the phase ended without an error, which every rank settled on together: lab._phase)
        return self._agreed(record.phase, super().veto(record, peak, end))

    def _agreed(self, phase: str, mine: Optional[HostMemoryExceeded]) -> Optional[Exception]:
        """Every rank's word on `phase` (a collective): this rank's own crossing, another's as PeerFailed, or None."""
        from ...runtime import PeerFailed, runtime

        ranks = runtime().agree(mine is not None)
        if not ranks:
            return None
        err = mine or PeerFailed(
            f"{phase} failed on rank {', '.join(map(str, ranks))}: its process crossed its memory line "
            "(placement.rank_memory_gib); every rank stopped it there and undid it"
        )
        err.agreed = True  # why: the phase's own decision (runtime.settle) must not wait for the others again
        return err

    def _exceeded(self, ratio: float, limit: float, where: str, mark: Optional[str] = None) -> HostMemoryExceeded:
        """The rank's one line (MemorySampler._exceeded's, for a rank's budget); `mark`: the tool loop's turn it
        crossed in, whose knobs lead the fixes."""
        from ...memory.mark_fixes import mark_fix
        from ...runtime import runtime

        turn = mark_fix(mark)
        error = HostMemoryExceeded(
            f"rank {runtime().rank}'s process reached {ratio:.1%} of its {limit / GiB:.2f} GiB "
            f"(placement.rank_memory_gib; memory.host_threshold={self.host_threshold}); {where}",
            f"{turn + '; ' if turn else ''}lower this rank's peak (a gathered rollout: "
            "generator.gather_for_generation: false; a pass: grpo.micro_batch_size; or more ranks), or raise "
            "placement.rank_memory_gib",
        )
        error.mark = mark
        return error


def cap_rank_gpu(gib: Optional[float], device: str) -> Optional[float]:
    """A GPU rank's CUDA allocator capped at `gib` (placement.rank_memory_gib) with
    torch.cuda.set_per_process_memory_fraction, so an allocation past it is an out-of-memory error on that rank;
    returns the cap in bytes (None: no budget, or a CPU rank)."""
    if not gib or not device.startswith("cuda"):
        return None
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(gib * GiB / total, 1.0), device)
    return min(gib * GiB, total)
