"""What torch compiled during a rollout, by its own counters (the hf backend's `CompileCounts`)."""

from __future__ import annotations


class CompileCounts:
    """What torch compiled within the block, by its own counters: dynamo's unique graphs and the inputs CUDA graph
    trees recorded (a re-record after a static input moved adds to it). Why in the rollout's result: a recompile or
    a re-record per rollout is the fast path's cost, and shows nowhere else."""

    KEYS = (("stats", "unique_graphs"), ("inductor", "cudagraph_recorded_non_static_inputs"))

    def __enter__(self) -> "CompileCounts":
        self.before = self.read()
        return self

    def __exit__(self, *exc) -> None:
        self.after = self.read()

    @classmethod
    def read(cls) -> tuple[int, ...]:
        from torch._dynamo.utils import counters

        return tuple(counters[group][key] for group, key in cls.KEYS)

    def delta(self) -> tuple[int, ...]:
        return tuple(a - b for a, b in zip(self.after, self.before))
