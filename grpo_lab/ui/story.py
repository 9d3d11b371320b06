"""What the guided notebooks (notebooks/02-06) share: each tells one failure as the failure -> why -> the fix -> the
same measurement, fitting.

- `Story(...)` checks the parameters cell's values first, so a preset the notebook cannot use stops right there in
  one line, and keeps the libraries' notices out of the outputs (ui/quiet.py).
- `trial()` runs one step (or one phase) under a memory budget and says whether it crossed.
- `fact()` records what the cells compute: `end()` shows them as one JSON output, the tests read it, and the prose
  quotes them by name.
- `show()` puts a figure in its output once: live where a person's frontend draws it, a PNG in a headless run, so a
  saved papermill output or GitHub shows the explanation too; `snapshot()` puts a live plot's timeline there.
"""

from __future__ import annotations

import json
from typing import Callable, Optional

from ..errors import LabError
from ..memory.readers import MiB, is_host
from ..memory.static import show

FACTS = "facts: "  # the text Story.end shows
FACTS_MIME = "application/json"  # the output Story.end writes and facts_in reads

__all__ = [
    "Story",
    "check_parameters",
    "peak_table",
    "show",
    "snapshot",
    "trial",
    "device_peak",
    "rank_peaks",
    "format_rank_peaks",
    "budget_line",
    "facts_in",
    "peak_metric",
    "host_limit",
    "turn_peaks",
    "format_turn_peaks",
]


def check_parameters(config, overrides=(), field: str = "config"):
    """The notebook's `config` (a preset or YAML) with `overrides`, loaded; one line naming the parameter when it is
    unknown, or places work on CUDA on a machine without it."""
    from ..checks.devices import cuda_device_count
    from ..config.loading import load_config

    try:
        loaded = load_config(config, list(overrides))
    except LabError as err:
        raise LabError(f"parameter {field}: {err}") from None
    devices = [loaded.placement.learner, *loaded.placement.generator_devices(), loaded.reference.device or "cpu"]
    cuda = [d for d in devices if d.startswith("cuda")]
    if cuda and cuda_device_count() == 0:
        raise LabError(
            f"parameter {field}: {config!r} places work on {cuda[0]}, and this machine has no CUDA device; run "
            "the notebook with a CPU config (its default), or on a GPU machine"
        )
    return loaded


def host_limit(limit: str) -> list[str]:
    """The override that holds a story's host budget: placement.host_limit `limit`; 'cgroup' where this machine can
    make a memory cgroup (the kernel kills at the budget, the live guard stops the phase at its line first), elsewhere
    one line saying why, and the guard alone holds the budget."""
    if limit == "cgroup":
        from ..memory.kernel_limit import unavailable

        why = unavailable()
        if why:
            print(f"host limit: the kernel cannot enforce the budget here ({why}); the guard alone holds it")
            return []
    return [f"placement.host_limit={limit}"]


class Story:
    """One notebook run: its checked config (`config` + `overrides`, + `on_cpu` when its learner is on the CPU) and
    the facts its cells compute."""

    def __init__(self, config, overrides=(), field: str = "config", on_cpu=()):
        from ..config.loading import load_config
        from ..errors import one_line_in_cells
        from .quiet import quiet_libraries

        one_line_in_cells()  # why first: a refused parameter is then its one line in the cell's output
        quiet_libraries()  # why: a saved story shows its own lines, not the libraries' notices or frozen bars
        self.config = check_parameters(config, overrides, field)
        if not self.on_gpu and on_cpu:  # why CPU only: a host budget for a CPU learner; a GPU's is its card
            self.config = load_config(self.config, list(on_cpu))
        self.facts: dict = {}

    def emulate_card(self, gib: float) -> None:
        """On a GPU config: cap this process's CUDA memory at a `gib` GiB card (torch.cuda.set_per_process_memory_
        fraction), so the trials measure against that card; a no-op on the CPU."""
        if not self.on_gpu:
            return
        import torch

        device = torch.device(self.config.placement.learner)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(gib * 2**30 / total, 1.0), device)
        self.fact("gpu", {"name": torch.cuda.get_device_name(device), "card_gib": gib, "total_gib": total / 2**30})

    @property
    def on_gpu(self) -> bool:
        return self.config.placement.learner.startswith("cuda")

    def fact(self, name: str, value):
        """Record `value` under `name` (the tests and the prose refer to it by that name); returns it."""
        self.facts[name] = value
        return value

    def gpu_cells(
        self,
        what: str = "",
        gpu_config: str = "a GPU config (papermill -p config qwen2.5-7b-nf4-24gb, "
        "or your own YAML) on a machine with CUDA",
    ) -> bool:
        """Whether this run's GPU cells run: its config's learner is on CUDA. Otherwise one line says what they would
        have measured (`what`) and what to run them with (`gpu_config`)."""
        if not self.on_gpu:
            skipped = f" ({what})" if what else ""
            print(
                f"GPU cells skipped: this config runs on the CPU, so this notebook's GPU measurement{skipped} does not "
                f"run; run with {gpu_config}"
            )
        return self.on_gpu

    def end(self) -> None:
        """The facts as one output: JSON for the tests (and JupyterLab's tree view), one short line as its text."""
        from IPython.display import display

        # why the round trip: numpy and torch scalars, and floats as printed (1361.92, not 1361.9199999999998)
        facts = json.loads(json.dumps(self.facts, default=float), parse_float=rounded)
        text = f"{FACTS}{', '.join(facts)} (recorded for the story's test)"
        display({FACTS_MIME: facts, "text/plain": text}, raw=True)


def rounded(text: str) -> float:
    """A fact's float as a story prints it: 2 decimals from 1 up, 6 significant digits below (a max abs diff)."""
    x = float(text)
    return round(x, 2) if abs(x) >= 1 else float(f"{x:.6g}")


def facts_in(nb) -> dict:
    """The facts an executed notebook (nbformat) recorded at its end (Story.end)."""
    found = [o["data"][FACTS_MIME] for c in nb.cells for o in c.get("outputs", []) if FACTS_MIME in o.get("data", {})]
    if len(found) != 1:
        raise ValueError(f"{len(found)} facts outputs in the notebook: Story.end runs once, in its last cell")
    return found[0]


def snapshot(lab, phases: Optional[list] = None) -> None:
    """After a live plot: the memory timeline so far as a PNG (with its budget lines), then each phase's measured
    peak per device as a table: what the live widget showed, kept in the saved notebook."""
    from IPython.display import HTML, display

    from ..memory.report import sampler_timeline

    show(sampler_timeline(lab.memory, phases))  # (`phases`: the image shows those, as the table does)
    display(HTML(peak_table(lab.memory.phase_rows, phases)))


def peak_metric(device: str) -> str:
    """The figure the stories read a device's peak from: the host guard's own `used` on the host (this Lab's RSS under
    placement.host_memory_gib, so a stop and a verdict read one number), torch's allocated peak on a GPU (exact per
    phase)."""
    return "used" if is_host(device) else "allocated"


TABLE_METRIC = {True: "rss", False: "allocated"}  # by is_host: the Lab's own figure on each device


def peak_table(rows, phases: Optional[list] = None) -> str:
    """Per step and phase (the ones in `phases`, or all), each device's peak in MiB, as an HTML table: the Lab's own
    figure (a host's RSS, a GPU's allocated). Why not the host guard's `used`: without placement.host_memory_gib it is
    the machine's, whatever else runs beside the Lab (under a budget the two are one figure)."""
    table_metric = lambda device: TABLE_METRIC[is_host(device)]
    picked = [r for r in rows if r["metric"] == table_metric(r["device"]) and (phases is None or r["phase"] in phases)]
    devices = list(dict.fromkeys(r["device"] for r in picked))
    head = "".join(f"<th>{d} {table_metric(d)} peak (MiB)</th>" for d in devices)
    lines = []
    key_of = lambda r: (r["step"], r["phase"], r.get("failed_attempt") is not None)  # (a step's first attempt is 0)
    for key in dict.fromkeys(map(key_of, picked)):
        peaks = {r["device"]: r["peak"] for r in picked if key_of(r) == key}
        cells = "".join(f"<td>{peaks[d] / MiB:,.0f}</td>" if d in peaks else "<td></td>" for d in devices)
        note = " (rolled back)" if key[2] else ""
        lines.append(f"<tr><td>{key[0]}</td><td>{key[1]}{note}</td>{cells}</tr>")
    return f"<table><tr><th>step</th><th>phase</th>{head}</tr>{''.join(lines)}</table>"


def trial(lab, label: str, run: Optional[Callable] = None, device: str = "host") -> dict:
    """Run `run` (default: one step) and measure it against the budget on `device` (host: the guard's line, limit x
    memory.host_threshold; a GPU: its capacity; "rank": the CPU rank the stop names, else rank 0). Returns {label,
    stopped (the guard's or the OOM's line, or None), peak_mib, line_mib, phase (where the peak was), crossed,
    phase_peaks_mib (of each phase run to its end), generate_calls (a step's)}; prints it in one line. The kernel
    stays usable."""
    first, since = len(lab.memory.phase_rows), lab.memory.total
    stopped, result, refused = None, None, None
    try:
        result = (run or lab.step)()
    except LabError as err:
        stopped, refused = str(err), getattr(err, "refused", None)
    if device == "rank":  # a sharded CPU Lab's: the rank its stop names ('... failed on rank K: ...'), else rank 0
        named = stopped.split(" failed on rank ")[1].split(":")[0] if stopped and " on rank " in stopped else "0"
        device = f"rank{named if named.isdigit() else 0}/host"
    top, rows = device_peak(lab, device, first)
    peak, line = top["peak_mib"], top["line_mib"]
    out = dict(label=label, stopped=stopped, peak_mib=peak, line_mib=line, phase=refused or top["phase"])
    # each phase this trial ran to its end (an undone attempt's rows are the crossing, not the phase's result)
    out["phase_peaks_mib"] = {r["phase"]: r["peak"] / MiB for r in rows if r["failed_attempt"] is None}
    out["generate_calls"] = getattr(result, "generate_calls", None)  # a step's rollout: how many engine calls
    out["over_line_s"] = seconds_over(lab, device, line, since)
    # why an OOM counts: an allocation past a card's cap fails, so the measured peak stays under the line it hit; and
    # the guard's refusal before one native call that would pass the line (algo/room.py), nothing allocated
    out["crossed"] = peak > line or bool(refused) or bool(stopped and "out of memory" in stopped.lower())
    # the plan beside the Lab's own figure of that phase (its RSS; the guard's `used` is the machine's unbudgeted)
    mine = rows_of(lab, device, first, TABLE_METRIC[is_host(device)])
    own = [r["peak"] / MiB for r in mine if r["phase"] == top["phase"]]
    planned = planned_peak_mib(lab, device, top["phase"])
    # why only a phase run to its end: one the guard stopped peaked where it was stopped, at the line, not where the
    # plan puts the phase's peak (its planned figure is printed alone)
    ran = not (stopped and f"during phase '{top['phase']}'" in stopped)
    out["plan_ratio"] = round(planned / max(own), 3) if planned and own and ran else None
    verdict = "refused before passing" if refused and peak <= line else "over" if out["crossed"] else "under"
    beside = f" (planned {planned:,.0f}: plan / measured {out['plan_ratio']:.2f})" if out["plan_ratio"] else ""
    beside = beside or (f" (planned {planned:,.0f}; stopped there, so no plan / measured)" if planned else "")
    print(
        f"{label}: peak {peak:,.0f} MiB during {out['phase']}{beside}, {verdict} the {line:,.0f} MiB line"
        + (f" -> {stopped}" if stopped else " -> the step ran")
    )
    return out


def seconds_over(lab, device: str, line_mib: float, since: int) -> float:
    """How long `device`'s peak figure stayed over `line_mib` in the samples from index `since`: from the first sample
    over it to the last (0 for one sample, or none)."""
    metric, line = peak_metric(device), line_mib * MiB
    over = [t for t, _, _, d, m, v in lab.memory.samples_since(since) if d == device and m == metric and v > line]
    return round(over[-1] - over[0], 3) if over else 0.0


def planned_peak_mib(lab, device: str, phase: str) -> Optional[float]:
    """The plan's peak of `phase` on `device` (a rank's host: its own block), in MiB, for the Lab's config as it is
    now; None where the plan has no such device or phase (a guard's reading between phases)."""
    from ..planner import plan
    from ..planner.estimate import PHASES

    if phase not in PHASES:
        return None
    name = f"host (rank {device[4 : device.index('/')]})" if device.startswith("rank") else device
    try:
        planned = plan(lab.config)
    except LabError:  # a config the planner cannot read is refused at load; a trial is no place to refuse it again
        return None
    where = {**planned.devices, **getattr(planned, "ranks", {})}.get(name)
    return where.phase_peak(phase) / MiB if where is not None else None


def device_peak(lab, device: str = "host", since: int = 0) -> tuple[dict, list]:
    """`device`'s peak in the per-phase rows from index `since` (undone attempts included) against its line, in MiB:
    ({peak_mib, phase, line_mib, over}, the rows read). A device with no row there (a guard that stopped before the
    first phase wrote one) is read from its latest sample."""
    memory, metric = lab.memory, peak_metric(device)
    rows = rows_of(lab, device, since, metric)
    top = max(rows, key=lambda r: r["peak"], default=None)
    peak, phase = (
        (top["peak"], top["phase"]) if top else (memory.latest(device).get(metric, 0.0), "the guard's reading")
    )
    line = budget_line(lab, device)
    return dict(peak_mib=peak / MiB, phase=phase, line_mib=line, over=peak / MiB > line), rows


def rows_of(lab, device: str, since: int, metric: str) -> list:
    """The per-phase rows of `device`'s `metric` from index `since` (undone attempts included)."""
    return [r for r in lab.memory.phase_rows[since:] if r["device"] == device and r["metric"] == metric]


def rank_peaks(lab, since: int = 0) -> dict[str, dict]:
    """Each rank's host peak from row `since` against its line (its budget x memory.host_threshold), as device_peak
    reads it: {'rank<k>/host': {peak_mib, phase, line_mib, over}}."""
    from ..memory.report import capacities_of

    budgeted = capacities_of(lab.memory)
    ranks = sorted({r["device"] for r in lab.memory.phase_rows[since:] if r["device"].startswith("rank")})
    return {d: device_peak(lab, d, since)[0] for d in ranks if is_host(d) and d in budgeted}


def format_rank_peaks(peaks: dict) -> str:
    """rank_peaks() as a table, one line per rank."""
    lines = [f"{'rank':<12}{'peak MiB':>10}  {'during':<10}{'line MiB':>10}  verdict"]
    for device, p in peaks.items():
        verdict = "over its line" if p["over"] else "under its line"
        lines.append(f"{device:<12}{p['peak_mib']:>10.1f}  {p['phase']:<10}{p['line_mib']:>10.1f}  {verdict}")
    return "\n".join(lines)


def budget_line(lab, device: str = "host") -> float:
    """The line a device's memory must stay under (MiB): the host guard's (limit x memory.host_threshold) or a GPU's
    capacity, as capped by emulate_card."""
    from ..memory.report import capacities_of

    capacity = capacities_of(lab.memory)[device]
    if is_host(device):
        return capacity * lab.memory.host_threshold / MiB
    return capacity * card_share(device) / MiB


def card_share(device: str) -> float:
    """The share of `device` this process may allocate (Story.emulate_card's cap), 1.0 when uncapped."""
    import torch

    share = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # why getattr: newer torch only
    return share(torch.device(device)) if share is not None else 1.0


def turn_peaks(lab, step: int, device: str = "host") -> list[dict]:
    """Each mark of `step`'s phases (a tool loop's turns and tools), its attempts undone included, in order: {mark,
    phase, peak_mib (the Lab's own figure: a host's RSS), undone}; the plan's peak of its phase beside it (planned_mib,
    the plan's worst turn: planner/turns.py); and, for each turn of the step's latest attempt that ran to its end, the
    plan of that turn as it ran (ran_mib: its generate() calls' shapes, Rollout.turn_shapes, the largest; else None)."""
    metric = TABLE_METRIC[is_host(device)]
    marks = [m for m in lab.memory.segments if m["step"] == step and (device, metric) in m["peak"]]
    ran = ran_peaks_mib(lab, device)
    latest = marks[-1]["failed_attempt"] if marks else None
    out = []
    for m in marks:
        peak, planned = m["peak"][(device, metric)] / MiB, planned_peak_mib(lab, device, m["phase"])
        as_run = ran.get(m["mark"]) if m["failed_attempt"] == latest else None
        out.append(dict(mark=m["mark"], phase=m["phase"], peak_mib=round(peak, 2), undone=m["failed_attempt"]
                        is not None, planned_mib=round(planned, 2) if planned else None,
                        ran_mib=round(as_run, 2) if as_run else None))  # fmt: skip
    return out


def ran_peaks_mib(lab, device: str = "host") -> dict[str, float]:
    """The latest rollout's turns as they ran ({"turn k": MiB}): each turn's generate() calls planned
    (planner.turns.turn_peaks on their shapes), the largest; empty where the shapes are not recorded (a backend
    other than hf) or the device is not the host the turns are planned on."""
    from ..planner.turns import Turn
    from ..planner.turns import turn_peaks as planned_turns

    shapes = getattr(getattr(lab.generator, "turns", None), "shapes", None)
    if not shapes or device != "host":
        return {}
    plan = lab.plan()
    out: dict[str, float] = {}
    for s in shapes:
        number = int(s["mark"].split()[1])
        peak = planned_turns(plan, [Turn(number, s["rows"], s["prefill"], s["context"], s["decode"])])[0] / MiB
        out[s["mark"]] = max(out.get(s["mark"], 0.0), peak)
    return out


def format_turn_peaks(peaks: list[dict]) -> str:
    """turn_peaks() as a table, one line per mark: the plan at its worst turn and the plan of the turn as it ran,
    each beside the measured peak."""
    lines = [f"{'mark':<10}{'measured MiB':>13}{'planned (worst)':>16}{'plan/measured':>14}{'planned (as run)':>17}"
             f"{'plan/measured':>14}  attempt"]  # fmt: skip
    for p in peaks:
        cells = []
        for key, width in (("planned_mib", 16), ("ran_mib", 17)):
            cells.append(f"{p[key]:,.0f}".rjust(width) if p.get(key) else "-".rjust(width))
            cells.append((f"{p[key] / p['peak_mib']:.2f}" if p.get(key) else "-").rjust(14))
        attempt = "undone" if p["undone"] else "kept"
        lines.append(f"{p['mark']:<10}{p['peak_mib']:>13,.0f}{''.join(cells)}  {attempt}")
    return "\n".join(lines)
