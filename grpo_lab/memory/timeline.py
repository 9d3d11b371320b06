"""The timeline: every phase of a step runs inside `timeline.phase(name, step)`, which times it and
tells listeners (the memory sampler, allocator snapshots) when it starts and ends. Phase names
come from `phases.PHASES` (a Lab) or are TRL's own (the TRL bridge)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class PhaseRecord:
    step: int
    phase: str
    start: float  # time.perf_counter()
    end: float
    failed_attempt: int | None = None  # set when the step was rolled back and this phase's work is redone

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Timeline:
    def __init__(self):
        self.records: list[PhaseRecord] = []
        # objects with phase_started(step, phase) / phase_ended(record, error); phase_ended may return an exception,
        # a veto (the host guard: the phase crossed its line), which fails a phase that ended without one
        self.listeners: list = []
        self.open: tuple[int, str, float] | None = None  # (step, phase, start) of the running phase

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
        vetoes = [veto for listener in self.listeners if (veto := listener.phase_ended(record, error)) is not None]
        if vetoes and error is None:  # every listener heard the end first
            raise vetoes[0]

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

    def retire(self, step: int, phases, attempt: int) -> None:
        """Mark `step`'s records of `phases` as a failed attempt's: kept for the record, out of the step's timings."""
        for r in self.records:
            if r.step == step and r.phase in phases and r.failed_attempt is None:
                r.failed_attempt = attempt

    def forget(self, step: int) -> None:
        """Drop every record of `step` (the worst-case probe's step, which is not a step of the run)."""
        self.records[:] = [r for r in self.records if r.step != step]

    def seconds(self, step: int) -> dict[str, float]:
        """Wall time per phase of `step` (summed when a phase ran more than once), failed attempts left out."""
        out: dict[str, float] = {}
        for r in self.records:
            if r.step == step and r.failed_attempt is None:
                out[r.phase] = out.get(r.phase, 0.0) + r.seconds
        return out
