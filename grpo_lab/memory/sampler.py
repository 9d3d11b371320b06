"""The memory sampler: a background thread reads every device at `memory.sample_hz`, and the
step's phase markers (it is a Timeline listener) take a reading at every phase start and end,
so even a phase shorter than one sampling period has its start, peak and end.

Per phase and device it keeps start / peak / end / delta; on CUDA the peak is torch's exact
`max_memory_allocated` since the phase began, not just the highest sample; on the host the kernel's peak RSS of this
process (VmHWM, reset at every phase start and mark: HostReader.peak), so a spike between two readings counts. The
host-RAM guard (P4: stop before the OS or Ray kills the process) runs while a phase's work runs (`live`,
memory/live_guard.py): the sample that sees host `used` cross `host_threshold` of its limit interrupts the work there,
the host read at LIVE_HZ meanwhile; and as the phase ends, the backstop: a phase whose host `used` peak crossed fails
then. Either way the Lab undoes it, its output included, and the retry runs it again with whatever the user changed,
as a real out-of-memory would force. A crossing between phases (a cell's own allocations) stops the next phase.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Optional

from ..algo.room import checked_by
from .exceeded import HostMemoryExceeded
from .live_guard import LiveGuard
from .mark_fixes import at_mark, mark_fix, peak_mark
from .readers import MiB, readers_for

# metrics summarised per phase (the others are still sampled and written to memory.csv)
SUMMARY_METRICS = {
    "host": ("rss", "used"),
    "cuda": ("allocated", "reserved", "cached", "engine", "device_used", "not_torch"),
}
# the host's reading rate while guarded work runs (live guard): a host read costs ~50 us (psutil), so at 200 Hz the
# sampler thread takes about 1% of a core; a loop allocating 1 GiB/s then passes the line by ~5 MiB before the read
# that stops it (bench/probes/live_guard_cost.py)
LIVE_HZ = 200.0


class MemorySampler:
    def __init__(
        self,
        devices: list[str],
        hz: float,
        host_threshold: float,
        describe_offload: Callable[[], str] = lambda: "",
        max_samples: int = 500_000,
        guard_host: bool = True,
        host_budget: Optional[float] = None,
        live: bool = False,
        kernel=None,
    ):
        self.kernel = kernel  # placement.host_limit: cgroup (memory/kernel_limit.py): the limit the host reader reads
        self.readers = readers_for(devices, host_budget, kernel)
        self.hz, self.host_threshold, self.describe_offload = hz, host_threshold, describe_offload
        self.guard_host = guard_host  # False on a sharded learner's rank: the driver guards the one host for all
        # `live`: stop guarded work (`guarded`) as it crosses, not only as its phase ends (this process's own Lab)
        self.live = LiveGuard() if live and guard_host else None
        self.samples: deque = deque(maxlen=max_samples)  # (t, step, phase, device, metric, bytes)
        self.total = 0  # samples ever taken (survives the deque's bound)
        self.step, self.phase = 0, "idle"
        self.phase_rows: list[dict] = []  # per-phase summary rows, all steps
        self.marks: list[tuple[int, str, float, float]] = []  # (step, phase, start, end) for plots
        self.undone: list[tuple[int, str, float, float]] = []  # the marks of phases rolled back and redone
        # marks inside a phase (`mark`: a tool loop's turns and tools in the rollout), each with its own peaks
        self.segments: list[dict] = []
        self._segment: Optional[dict] = None  # the open one
        self._open: Optional[dict] = None  # start reading and running peaks of the current phase
        self._host_max_ratio = 0.0  # the highest host used/limit of the samples taken between phases
        self._vetoed = False  # a phase was just failed for crossing: its memory is being freed, not counted
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.t0 = time.perf_counter()

    def attach_engine(self, device: str, share: Callable[[], tuple[float, float]]) -> None:
        """An in-process vLLM engine on `device`: its (books, resident) bytes become the GPU ledger's own layer."""
        for reader in self.readers:
            if reader.device == device:
                reader.engine = share

    # --- the thread ---
    def start(self) -> "MemorySampler":
        if self.kernel is not None and self.kernel.lifted:
            self.kernel.enforce()  # why: a closed Lab loaded again is held by the kernel again
        if self.hz > 0 and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="grpo-lab-memory", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    def close(self) -> None:
        """Stop the thread and lift a kernel-enforced limit (the Lab closed; its records stay readable)."""
        self.stop()
        if self.kernel is not None:
            self.kernel.lift()

    def _loop(self) -> None:
        last = 0.0
        while self.hz > 0 and not self._stop.wait(self._tick()):  # why read hz each time: memory.sample_hz is editable
            now = time.perf_counter()
            if now - last >= 1.0 / max(self.hz, 1e-9):
                last = now
                self.read()
            elif self.live is not None and self.live.armed:
                self.watch_host()

    def _tick(self) -> float:
        """Seconds to the next reading: the sampling period, or the live guard's while guarded work runs."""
        period = 1.0 / max(self.hz, 1e-9)
        return min(period, 1.0 / LIVE_HZ) if self.live is not None and self.live.armed else period

    def guarded(self, work: Callable, *args):
        """`work(*args)` (a phase's work, in the thread that runs the phase) under the live guard, when this sampler
        has one: the reading that sees the host cross its line raises the guard's error in that thread."""
        if self.live is None:
            return work(*args)
        with checked_by(self.check_room):  # why: one native call past the line would land only as it returns
            return self.live.run(work, *args)

    def check_room(self, nbytes: int, what: str) -> None:
        """The live guard before one big native allocation (algo/room.py): `nbytes` more than the room left under
        the line now raises its one-line error here, before anything is allocated."""
        host = self.readers[0].read()
        ratio = (host["used"] + nbytes) / host["limit"]
        if ratio <= self.host_threshold:
            return
        room, mark = max(host["limit"] * self.host_threshold - host["used"], 0) / MiB, self.open_mark()
        where = (
            f"during phase {self.phase!r} of step {self.step}{at_mark(mark)}, before {what} ({nbytes / MiB:,.0f} MiB; "
        )
        error = self._exceeded(ratio, host["limit"], f"{where}{room:,.0f} MiB left under the line)", mark)
        error.where = error.where.replace("host RAM reached", "host RAM would reach", 1)
        error.refused = self.phase  # the phase stopped before its allocation (its peak stays under the line)
        self._vetoed = True  # why: what the stopped phase holds is freed next, not a crossing
        raise error

    def watch_host(self) -> None:
        """The live guard's reading between samples: the host alone, into the open phase's peaks; one over the line
        is taken as a full sample (recorded, and it interrupts the work)."""
        host = {("host", k): v for k, v in self.readers[0].read().items()}
        if self.host_ratio(host) > self.host_threshold:
            self.read()
            return
        with self._lock:
            if self._open is not None:
                self._raise_peaks(host)

    def _raise_peaks(self, reading: dict) -> None:
        """The open phase's (and its open mark's) running peaks, raised by `reading` (under the lock)."""
        for peaks in [self._open["peak"]] + ([self._segment["peak"]] if self._segment else []):
            for key, value in reading.items():
                peaks[key] = max(peaks.get(key, value), value)

    def mark(self, label: str) -> None:
        """Start a mark inside the running phase (a tool loop's `turn 2`, `tools 1`): it runs to the next mark or
        the phase's end, with its own peaks (the reading taken here is the end of the one before and the start of
        this one). Outside a phase: nothing."""
        reading = self.read()
        self._fold_exact_peaks(reset=True)  # why reset: the next mark's exact peak is its own
        with self._lock:
            if self._open is None:
                return
            self._close_segment(reading)
            t = time.perf_counter() - self.t0
            self._segment = {"step": self.step, "phase": self.phase, "mark": label, "start": t, "end": t,
                             "peak": dict(reading), "failed_attempt": None}  # fmt: skip
            self.segments.append(self._segment)

    def _fold_exact_peaks(self, reset: bool) -> None:
        """Raise the open phase's and mark's peaks to the host's exact peak since its last reset; then restart it."""
        host = self.readers[0]  # (a reader without `peak`: its readings alone)
        exact = {(host.device, metric): value for metric, value in getattr(host, "peak", dict)().items()}
        with self._lock:
            if self._open is not None:
                self._raise_peaks(exact)
        if reset and exact:
            host.reset_peak()

    def _close_segment(self, reading: dict) -> None:
        if self._segment is not None:
            for key, value in reading.items():
                self._segment["peak"][key] = max(self._segment["peak"].get(key, value), value)
            self._segment["end"] = time.perf_counter() - self.t0
            self._segment = None

    def mark_rows(self, step: int) -> list[dict]:
        """The marks of `step`'s completed attempt, one row per mark x device x summary metric: its peak, its
        seconds (the step's metrics: each turn's peak)."""
        rows = []
        for m in self.segments:
            if m["step"] != step or m["failed_attempt"] is not None:
                continue
            for (device, metric), peak in m["peak"].items():
                if metric in SUMMARY_METRICS["host" if device.split("/")[-1] == "host" else "cuda"]:  # (rank<k>/host)
                    rows.append({"step": step, "phase": m["phase"], "mark": m["mark"], "device": device,
                                 "metric": metric, "peak": peak, "seconds": m["end"] - m["start"]})  # fmt: skip
        return rows

    def set_rate(self, hz: float) -> None:
        """Change the sampling rate of a running sampler (0 stops the thread; readings stay at phase boundaries)."""
        self.hz = hz
        if hz == 0:
            self.stop()
        else:
            self.start()

    # --- readings ---
    def read(self) -> dict[tuple[str, str], float]:
        """Read every device once, record the samples, update the open phase's peaks."""
        t = time.perf_counter() - self.t0
        reading = {}
        for reader in self.readers:
            for metric, value in reader.read().items():
                reading[(reader.device, metric)] = value
        with self._lock:
            for (device, metric), value in reading.items():
                self.samples.append((t, self.step, self.phase, device, metric, value))
            self.total += len(reading)
            if self._open is not None:
                self._raise_peaks(reading)
            elif not self._vetoed:  # why: a crossing inside a phase is that phase's (phase_ended)
                self._host_max_ratio = max(self._host_max_ratio, self.host_ratio(reading))
        if self.live is not None and self.live.armed:
            self._stop_at_line(reading)
        return reading

    def _stop_at_line(self, reading) -> None:
        """The live guard: host `used` over the line while guarded work runs interrupts that work, with the one-line
        error the after-phase veto gives."""
        ratio = self.host_ratio(reading)
        if ratio <= self.host_threshold:
            return
        mark = self.open_mark()  # (a tool loop's turn: the line names it, and the knobs that lower it)
        where = f"during phase {self.phase!r} of step {self.step}{at_mark(mark)}"
        error = self._exceeded(ratio, reading[("host", "limit")], where, mark)
        error.requote = (reading[("host", "limit")], where)  # (phase_ended quotes the phase's peak, as the veto does)
        # why first: until the next phase starts, the stopped phase's memory is freed, not a crossing (and sent to
        # this very thread, the error is raised as soon as `interrupt` returns)
        self._vetoed = True
        self.live.interrupt(error)

    @staticmethod
    def host_ratio(reading) -> float:
        return reading[("host", "used")] / reading[("host", "limit")]

    # --- Timeline listener ---
    def phase_started(self, step: int, phase: str) -> None:
        self.check_host(step, phase)
        self._vetoed = False
        for reader in self.readers:
            if hasattr(reader, "reset_peak"):
                reader.reset_peak()  # why: torch's peak then covers exactly this phase
        with self._lock:
            self.step, self.phase = step, phase
        start = self.read()
        with self._lock:
            self._open = {"start": start, "peak": dict(start), "t": time.perf_counter() - self.t0}

    def running(self):
        """(step, phase, start) of the phase under way (start: seconds since the sampler started), or None."""
        with self._lock:
            return None if self._open is None else (self.step, self.phase, self._open["t"])

    def phase_ended(self, record, error) -> Optional[HostMemoryExceeded]:
        """Close the phase's rows; returns the guard's veto when its host peak crossed the line (the timeline raises
        it, so the phase fails as it ends and the Lab undoes it)."""
        end = self.read()
        self._fold_exact_peaks(reset=False)
        with self._lock:
            self._close_segment(end)
            opened, self._open = self._open, None
            self.phase = "idle"
        if opened is None:
            return None
        self.marks.append((record.step, record.phase, opened["t"], time.perf_counter() - self.t0))
        for key, value in end.items():  # why: the end is a reading of the phase too (a native call after the last)
            opened["peak"][key] = max(opened["peak"].get(key, value), value)
        for (device, metric), start in opened["start"].items():
            kind = "host" if device == "host" else "cuda"
            if metric not in SUMMARY_METRICS[kind]:
                continue
            peak = opened["peak"][(device, metric)]
            if metric == "allocated":
                peak = max(peak, end.get((device, "peak"), peak))
            self.phase_rows.append(
                {
                    "step": record.step,
                    "phase": record.phase,
                    "device": device,
                    "metric": metric,
                    "start": start,
                    "peak": peak,
                    "end": end[(device, metric)],
                    "delta": end[(device, metric)] - start,
                    "failed": error is not None,
                    "failed_attempt": None,
                }
            )
        if getattr(error, "requote", None) and ("host", "used") in opened["peak"]:
            # why: the phase ran on past the crossing until the error landed (a native call returns first); its one
            # line quotes the peak its row records, as the after-phase veto's does
            limit, where = error.requote
            error.where = self._exceeded(opened["peak"][("host", "used")] / limit, limit, where).where
        return None if error is not None else self.veto(record, opened["peak"], end)

    def veto(self, record, peak: dict, end: dict) -> Optional[HostMemoryExceeded]:
        """The guard's word on a phase that ended: its host `used` peak (the figure its row records) over the line."""
        if not self.guard_host or ("host", "used") not in peak:
            return None
        ratio = peak[("host", "used")] / end[("host", "limit")]
        if ratio <= self.host_threshold:
            return None
        self._vetoed = True  # why: until the next phase starts, the undone phase's memory is freed, not a new crossing
        mark = peak_mark(self.segments, record.step, record.phase)  # (the mark of its peak: where it crossed)
        where = f"during phase {record.phase!r} of step {record.step}{at_mark(mark)}"
        return self._exceeded(ratio, end[("host", "limit")], where, mark)

    def check_host(self, step: int, phase: str) -> None:
        """Refuse to start `phase` when host RAM is over the threshold now, or crossed it between phases."""
        if not self.guard_host:
            return
        reading = {("host", k): v for k, v in self.readers[0].read().items()}
        with self._lock:
            ratio = max(self._host_max_ratio, self.host_ratio(reading))
            self._host_max_ratio = 0.0
        if ratio > self.host_threshold:
            raise self._exceeded(ratio, reading[("host", "limit")], f"stopped before phase {phase!r} of step {step}")

    def open_mark(self) -> Optional[str]:
        """The label of the mark under way in the running phase (None: none)."""
        segment = self._segment
        return segment["mark"] if segment is not None else None

    def _exceeded(self, ratio: float, limit: float, where: str, mark: Optional[str] = None) -> HostMemoryExceeded:
        gib = limit / 1024**3
        offload = "; ".join(f for f in (mark_fix(mark), self.describe_offload()) if f)
        budget = (
            " (placement.host_memory_gib, the kernel's limit on this process)"
            if self.kernel is not None
            else " (placement.host_memory_gib, this Lab's processes)"
            if self.readers[0].budget
            else ""
        )
        error = HostMemoryExceeded(
            f"host RAM reached {ratio:.1%} of {gib:.{1 if gib >= 1 else 2}f} GiB{budget} "
            f"(memory.host_threshold={self.host_threshold}); {where}",
            f"{offload + '; ' if offload else ''}free host memory, move state off the host, "
            "or raise memory.host_threshold with care",
        )
        error.mark = mark
        return error

    # --- views ---
    def retire(self, step: int, phases, attempt: int) -> None:
        """Mark `step`'s rows of `phases` as a failed attempt's (the step was rolled back and that work is redone)."""
        with self._lock:
            for r in self.phase_rows:
                if r["step"] == step and r["phase"] in phases and r["failed_attempt"] is None:
                    r["failed_attempt"] = attempt
            self.undone += [m for m in self.marks if m[0] == step and m[1] in phases and m not in self.undone]
            for m in self.segments:
                if m["step"] == step and m["phase"] in phases and m["failed_attempt"] is None:
                    m["failed_attempt"] = attempt

    def forget(self, step: int) -> list[dict]:
        """Take every per-phase row of `step` out (the worst-case probe's step); returns them."""
        with self._lock:
            rows = [r for r in self.phase_rows if r["step"] == step]
            self.phase_rows[:] = [r for r in self.phase_rows if r["step"] != step]
            self.segments[:] = [m for m in self.segments if m["step"] != step]
        return rows

    def rows_for(self, step: int, failed_attempts: bool = False) -> list[dict]:
        """The per-phase rows of `step`: of the attempt that completed it, or with `failed_attempts` of those rolled
        back."""
        return [
            r for r in self.phase_rows if r["step"] == step and (r["failed_attempt"] is not None) == failed_attempts
        ]

    def latest(self, device: str) -> dict[str, float]:
        return {metric: value for (dev, metric), value in self.read().items() if dev == device}

    def samples_since(self, index: int) -> list[tuple]:
        """Samples with absolute index >= `index` that are still held (for streaming to CSV)."""
        with self._lock:
            held_from = self.total - len(self.samples)
            return list(self.samples)[max(index - held_from, 0) :]

    def segments_since(self, index: int) -> list[dict]:
        """The marks from the `index`-th on that have ended (a running one is left for the next look), copied (for a
        rank's reply to its driver)."""
        with self._lock:
            ended = self.segments[index : len(self.segments) - (self._segment is not None)]
            return [{**m, "peak": dict(m["peak"])} for m in ended]
