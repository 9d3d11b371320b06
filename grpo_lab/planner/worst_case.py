"""The worst-case probe (`lab.probe()`, `grpo-lab probe`, `run.probe_first`): one step at the largest shapes the
config allows, on the real devices, before a run meets them hours in. Every prompt of the batch is the dataset's
longest (cut at max_prompt_length, as a rollout cuts it), every completion runs to max_completion_length (stop
tokens suppressed), so every micro-batch is full. Its per-phase peaks print beside the plan's, with a verdict.

It leaves nothing behind: the LoRA weights, optimizer state, RNG states, data position and step index are put back
from a checkpoint taken first (the generator is synced to them), and the probe's step is kept out of the history,
the trackers, the leak detector and the memory views (its rows live in the report only).
"""

from __future__ import annotations

import copy
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

from ..algo.phases import PHASE_NAMES
from ..errors import LabError
from ..memory.readers import MiB

PROBE_STEP = -1  # the step index the probe's phases are recorded under, then removed


class WorstCasePrompts:
    """Stands in for the Lab's prompt source during the probe: every batch is the longest prompt, repeated, and
    the rollout is asked for full-length completions (step.rollout reads `full_length`)."""

    full_length = True

    def __init__(self, source, max_prompt_length: int):
        self.row, self.tokens = source.longest(max_prompt_length)
        self.source = source

    def next_batch(self, size: int):
        return self.source.batch_of([self.row] * size)

    def lengths(self):
        """The real source's prompt lengths (the plan beside the probe reads the data's longest)."""
        return self.source.lengths()

    def rewind(self) -> None:
        """Every batch is the same: nothing to go back to (the real source's position is untouched by the probe)."""

    def draw_for(self, step: int) -> None:
        """As rewind: a failed probe rollout has no draw to give back."""

    undraw = draw_for


class _NoTrackers:
    def log(self, result) -> None:  # why: a probe is not a step of the run; no tracker sees it
        pass


@dataclass
class ProbeReport:
    """What the probe measured per phase and device, beside what the plan expected, and the verdict."""

    rows: list[dict]  # the sampler's per-phase rows of the probe step
    planned: dict[str, dict[str, float]]  # device -> phase -> planned peak (bytes)
    capacity: dict[str, float]  # device -> what it may hold (host: limit x memory.host_threshold)
    prompt_tokens: int
    completion_tokens: int
    failure: Optional[str] = None  # the one-line error a phase raised (out of memory, host guard), if any
    failed_phase: Optional[str] = None
    over: list[tuple[str, str, float]] = field(default_factory=list)  # (device, phase, peak) above capacity

    @property
    def fits(self) -> bool:
        return self.failure is None and not self.over

    @property
    def verdict(self) -> str:
        if self.failure is not None:
            return f"does not fit: phase {self.failed_phase}: {self.failure}"
        if self.over:
            device, phase, peak = self.over[0]
            return (
                f"does not fit: {device} reached {peak / MiB:,.0f} MiB in phase {phase}, above the "
                f"{self.capacity[device] / MiB:,.0f} MiB it may hold"
            )
        return "fits"

    def measured(self, device: str, phase: str, metric: Optional[str] = None) -> Optional[float]:
        """The probe's peak of `metric` (default: what the plan predicts: this process's RSS on the host, torch's
        allocated on a GPU) on `device` in `phase`."""
        metric = metric or ("rss" if device == "host" else "allocated")
        peaks = [
            r["peak"] for r in self.rows if r["device"] == device and r["phase"] == phase and r["metric"] == metric
        ]
        return max(peaks) if peaks else None

    def __str__(self) -> str:
        lines = [
            f"worst-case probe: {self.prompt_tokens}-token prompts, {self.completion_tokens}-token completions, "
            "every micro-batch full (nothing it changed is kept)",
            f"  {'device':<10}{'phase':<12}{'planned MiB':>13}{'measured MiB':>14}{'host used MiB':>15}",
        ]
        for device, phases in self.planned.items():
            for phase in PHASE_NAMES:
                got = self.measured(device, phase)
                if got is None and phase not in phases:
                    continue
                plan = f"{phases[phase] / MiB:,.0f}" if phase in phases else "-"
                seen = "-" if got is None else f"{got / MiB:,.0f}"
                used = self.measured(device, phase, "used") if device == "host" else None
                lines.append(
                    f"  {device:<10}{phase:<12}{plan:>13}{seen:>14}{'' if used is None else f'{used / MiB:,.0f}':>15}"
                )
        lines.append(
            f"  (measured: this process's RSS on the host, torch's allocated peak on a GPU; host used: the "
            f"machine's, which the guard holds under {self.capacity.get('host', 0) / MiB:,.0f} MiB)"
        )
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))


def check_probe(lab) -> None:
    """What the probe refuses, in one line each, before it changes anything."""
    if lab.config.placement.learner_procs > 1:
        raise LabError(
            "lab.probe(): a sharded learner's ranks hold their own prompts and state; probe the same config "
            "with placement.learner_procs: 1 on one device, or rely on grpo-lab plan"
        )
    if not lab.executor.loaded:
        raise LabError("lab.probe(): the lab is not loaded; call lab.load() first (the probe runs on the real devices)")
    lab.between_steps("lab.probe()")


@contextmanager
def _worst_case(lab):
    """The Lab as the probe runs it: worst-case prompts, no trackers, a leak detector of its own, step PROBE_STEP."""
    ex = lab.executor
    saved = ex.prompts, lab.trackers, lab.leaks, lab.current, len(lab.history)
    ex.prompts = WorstCasePrompts(ex.prompts, lab.config.generator.max_prompt_length)
    lab.trackers, lab.leaks = _NoTrackers(), copy.deepcopy(lab.leaks)
    lab.resume_at(PROBE_STEP)
    try:
        yield ex.prompts
    finally:
        ex.prompts, lab.trackers, lab.leaks = saved[0], saved[1], saved[2]
        del lab.history[saved[4] :]
        lab.current = saved[3]


def probe(lab) -> ProbeReport:
    """One step at the largest shapes the config allows; everything it changed is put back (see the module)."""
    from ..recovery.checkpoint import read_checkpoint

    check_probe(lab)
    plan = lab.plan()
    threshold = lab.config.memory.host_threshold
    error = None
    with tempfile.TemporaryDirectory(prefix="grpo-lab-probe-") as tmp:
        lab.executor.save_checkpoint(tmp)  # why a checkpoint: it is what puts weights, AdamW, RNG and data back
        try:
            with _worst_case(lab) as prompts:
                try:
                    lab.step()
                except LabError as err:  # out of memory (one line already), the host guard, a diverged loss
                    error, phase = err, lab.next_phase()
        finally:  # the probe's step is not a step of the run: its rows go to the report only
            rows = lab.memory.forget(PROBE_STEP)
            lab.timeline.forget(PROBE_STEP)
            lab.executor.restore_checkpoint(read_checkpoint(tmp))
    report = ProbeReport(rows, {}, {}, prompts.tokens, lab.config.generator.max_completion_length)
    for name, device in plan.devices.items():
        # why allocated_peak: on a GPU the probe measures torch's allocated bytes, which never hold the CUDA context
        report.planned[name] = {p: device.allocated_peak(p) for p in ("rollout", "logprobs", "backward")}
        report.capacity[name] = device.capacity
    # the host may hold its limit as the guard reads it (cgroup or machine) x memory.host_threshold: the guard's line
    report.capacity["host"] = lab.memory.latest("host")["limit"] * threshold
    report.over = [
        (r["device"], r["phase"], r["peak"])
        for r in rows
        if r["metric"] in ("used", "allocated")
        and r["device"] in report.capacity
        and r["peak"] > report.capacity[r["device"]]
    ]
    if error is not None:
        report.failure = str(error).splitlines()[0]
        report.failed_phase = phase  # (the host guard fails the phase that crossed its line: it is the one to redo)
    return report


def probe_at_load(lab) -> ProbeReport:
    """run.probe_first: probe, print the report, and refuse in one line when the worst case does not fit."""
    report = probe(lab)
    print(report)
    if not report.fits:
        raise LabError(
            f"run.probe_first: the worst-case step ({report.prompt_tokens}-token prompts, "
            f"{report.completion_tokens}-token completions) {report.verdict}; lower generator.max_prompt_length, "
            "generator.max_completion_length or grpo.micro_batch_size (grpo-lab plan --frontier shows what "
            f"fits), or set run.probe_first: false to meet it mid-run"
        )
    return report
