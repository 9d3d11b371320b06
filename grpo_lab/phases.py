"""Phase markers: every phase of a step runs inside `timeline.phase(name)`, which times it and
tells listeners (the memory sampler, progress displays) when it starts and ends."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

PHASES = ("rollout", "rewards", "advantages", "logprobs", "backward", "optimizer", "sync")


@dataclass
class PhaseRecord:
    step: int
    phase: str
    start: float   # time.perf_counter()
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Timeline:
    def __init__(self):
        self.records: list[PhaseRecord] = []
        self.listeners: list = []   # objects with phase_started(step, phase) / phase_ended(record, error)
        self.open: tuple[int, str, float] | None = None   # (step, phase, start) of the running phase

    def begin(self, name: str, step: int) -> None:
        """Start a phase (for callers that cannot use `with`, such as trainer callbacks)."""
        for listener in self.listeners:
            listener.phase_started(step, name)
        self.open = (step, name, time.perf_counter())

    def end(self, error: BaseException | None = None) -> None:
        if self.open is None:
            return
        step, name, start = self.open
        self.open = None
        record = PhaseRecord(step, name, start, time.perf_counter())
        self.records.append(record)
        for listener in self.listeners:
            listener.phase_ended(record, error)

    @contextmanager
    def phase(self, name: str, step: int):
        self.begin(name, step)
        error = None
        try:
            yield
        except BaseException as err:
            error = err
            raise
        finally:
            self.end(error)

    def seconds(self, step: int) -> dict[str, float]:
        """Wall time per phase of `step` (summed when a phase ran more than once)."""
        out: dict[str, float] = {}
        for r in self.records:
            if r.step == step:
                out[r.phase] = out.get(r.phase, 0.0) + r.seconds
        return out
