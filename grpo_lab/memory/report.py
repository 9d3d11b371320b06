"""Run reports: DIR/memory.csv (every sample, with step and phase) and a self-contained DIR/report.html
(a summary of what peaked where and when, the memory timeline, a phase x step heatmap per device, reward
and loss, tool calls and failures per step in a run with tools, the per-phase table; figures.py draws them)."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from ..files import atomic_write_text
from .figures import LEDGER, LEDGER_NAMES, primary_metric, timeline_figure
from .readers import MiB, is_host
from .step_figures import heatmap_figure, training_figure
from .tables import tool_table

CSV_HEADER = ["seconds", "step", "phase", "device", "metric", "bytes"]
MARKS_CSV = "marks.csv"
MARKS_HEADER = ["step", "phase", "mark", "start", "end", "device", "metric", "peak_bytes", "failed_attempt"]


class CsvStream:
    """Appends the sampler's new samples to memory.csv; call `flush()` after each step. A resumed run
    (`keep_before`: the step it resumes at) keeps the earlier steps' rows and goes on after their time."""

    def __init__(self, path: Path, sampler, keep_before: int | None = None):
        self.path, self.sampler, self.index = Path(path), sampler, 0  # from the first sample: loading included
        kept = _rows_before(self.path, keep_before) if keep_before else []
        self.offset = max((float(r[0]) for r in kept), default=0.0)
        # why: a resumed process's loading samples belong to its first step, not to step 0
        self.floor = keep_before or 0
        buffer = io.StringIO()
        csv.writer(buffer).writerows([CSV_HEADER, *kept])
        atomic_write_text(self.path, buffer.getvalue())

    def flush(self) -> None:
        rows = self.sampler.samples_since(self.index)
        self.index += len(rows)
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerows(
                (f"{t + self.offset:.4f}", max(step, self.floor), phase, dev, metric, int(v))
                for t, step, phase, dev, metric, v in rows
            )
        if getattr(self.sampler, "segments", None):  # the marks inside phases: a tool loop's turns and tools
            write_marks(self.path.with_name(MARKS_CSV), self.sampler.segments, self.offset)


def write_marks(path: Path, segments: list[dict], offset: float = 0.0) -> None:
    """DIR/marks.csv, the timeline's marks inside phases (memory/sampler.py `mark`): one row per mark x device x
    metric, its start and end on memory.csv's clock and its peak; a rolled-back attempt's marks say which."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(MARKS_HEADER)
    for m in segments:
        for (device, metric), peak in m["peak"].items():
            writer.writerow([m["step"], m["phase"], m["mark"], f"{m['start'] + offset:.4f}", f"{m['end'] + offset:.4f}",
                             device, metric, int(peak), m["failed_attempt"] or ""])  # fmt: skip
    atomic_write_text(path, buffer.getvalue())


def _rows_before(path: Path, step: int) -> list[list[str]]:
    """The complete rows of steps before `step` (a row cut short by a kill is dropped)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))[1:]
    except OSError:
        return []
    return [r for r in rows if len(r) == len(CSV_HEADER) and r[1].isdigit() and int(r[1]) < step and r[5].isdigit()]


def capacities_of(sampler) -> dict[str, float]:
    """Each sampled device's capacity (bytes): the host's limit (cgroup or RAM), each GPU's total."""
    host = sampler.latest("host")
    out = {"host": host["limit"]} if host.get("limit") else {}
    out.update({reader.device: reader.total for reader in sampler.readers[1:]})
    out.update(getattr(sampler, "rank_capacities", {}))  # a sharded Lab's ranks' devices (each rank measured its own)
    return out


def sampler_timeline(sampler, phases=None):
    """The sampler's memory timeline so far with its capacity and threshold lines (samples read under its lock: the
    sampling thread may be running); `phases`: those only."""
    undone = getattr(sampler, "undone", ())  # (a sharded Lab's driver keeps its ranks' marks only)
    segments = list(getattr(sampler, "segments", []))
    return timeline_figure(sampler.samples_since(0), sampler.marks, host_limits(sampler), undone, phases, segments)


def host_limits(sampler) -> dict[str, float]:
    """Capacity and threshold lines for the plots (MiB): a budgeted rank's (placement.rank_memory_gib) is its guard's
    line, memory.host_threshold of its budget, one line for the ranks that share it."""
    limits, capacities = {}, capacities_of(sampler)
    budgets: dict[float, list[str]] = {}
    for device, capacity in capacities.items():
        if is_host(device) and device != "host":
            # a rank's host is this machine's, drawn once; a budget below it is the line that rank is held to
            if capacity < capacities.get("host", float("inf")):
                budgets.setdefault(capacity, []).append(device.split("/")[0])
            continue
        if device == "host":
            limits["host limit"] = capacity / MiB
            limits[f"host threshold {sampler.host_threshold:.0%}"] = capacity * sampler.host_threshold / MiB
        else:
            limits[f"{device} capacity"] = capacity / MiB
    for capacity, ranks in sorted(budgets.items()):
        limits[f"{', '.join(ranks)} line ({sampler.host_threshold:.0%} of its budget)"] = (
            capacity * sampler.host_threshold / MiB
        )
    return limits


def device_summary(rows, capacities: dict[str, float]) -> list[dict]:
    """Per device: its peak (primary metric), the phase and step it happened in, capacity and headroom (bytes)."""
    out = []
    for device in dict.fromkeys(r["device"] for r in rows):
        mine = [r for r in rows if r["device"] == device and not r.get("failed_attempt")]
        metric = primary_metric(device, {r["metric"] for r in mine})
        top = max((r for r in mine if r["metric"] == metric), key=lambda r: r["peak"], default=None)
        if top is None:
            continue
        capacity = capacities.get(device)
        ledger = (
            {
                r["metric"]: r["peak"]
                for r in mine
                if r["metric"] in LEDGER  # a GPU's: where its peak phase's memory went
                and (r["step"], r["phase"]) == (top["step"], top["phase"])
            }
            if not is_host(device)
            else {}
        )
        out.append(
            {
                "device": device,
                "metric": metric,
                "peak": top["peak"],
                "phase": top["phase"],
                "step": top["step"],
                "capacity": capacity,
                "headroom": None if capacity is None else capacity - top["peak"],
                "ledger": ledger,
            }
        )
    return out


def _summary_html(summary: list[dict], leaks: list[str]) -> str:
    import html

    lines = []
    for d in summary:
        cap = (
            f" of {d['capacity'] / MiB:,.0f} MiB ({d['peak'] / d['capacity']:.0%}; headroom "
            f"{d['headroom'] / MiB:,.0f} MiB)"
            if d["capacity"]
            else ""
        )
        went = "; ".join(f"{LEDGER_NAMES[m]} {d['ledger'][m] / MiB:,.0f}" for m in LEDGER if m in d.get("ledger", {}))
        went = f" <span class='ledger'>(peaks in that phase, MiB: {html.escape(went)})</span>" if went else ""
        lines.append(
            f"<li class='peak'><b>{html.escape(d['device'])}</b>: peak {d['peak'] / MiB:,.0f} MiB "
            f"({html.escape(d['metric'])}){cap}, in phase <b>{html.escape(d['phase'])}</b> of step "
            f"<b>{d['step']}</b>{went}</li>"
        )
    verdict = f"after-step memory kept rising on {', '.join(leaks)}" if leaks else "no device flagged"
    lines.append(f"<li class='leaks'><b>Leak detector</b>: {html.escape(verdict)}</li>")
    return "<ul class='summary'>" + "".join(lines) + "</ul>"


def _table_html(rows) -> str:
    """The per-phase rows as an HTML table, MiB."""
    head = "".join(f"<th>{h}</th>" for h in ("phase", "device", "metric", "start", "peak", "end", "delta"))
    body = "".join(
        f"<tr><td>{r['phase']}</td><td>{r['device']}</td><td>{r['metric']}</td>"
        + "".join(f"<td style='text-align:right'>{r[k] / MiB:,.1f}</td>" for k in ("start", "peak", "end", "delta"))
        + "</tr>"
        for r in rows
    )
    return f"<table class='phases' border='1' cellspacing='0' cellpadding='3'><tr>{head}</tr>{body}</table>"


def _unfinished_table(rows) -> str:
    """With no finished step (the first one failed), the table of the step that ran, so it is not lost."""
    if not rows:
        return ""
    step = rows[-1]["step"]
    return (
        f"<h2>Per-phase memory, step {step}, which did not finish (MiB)</h2>"
        f"{_table_html([r for r in rows if r['step'] == step])}"
    )


def write_report(path: Path, sampler, history, title: str = "grpo_lab run", config: dict | None = None) -> Path:
    """A self-contained HTML file (plotly.js inlined once): the summary first (per device: peak, where and when,
    headroom; the leak verdict; the config), then the timeline, a heatmap per device, reward/loss, tool calls and
    failures per step (a run with tools) and the table."""
    import html

    import plotly.io as pio
    import yaml

    rows = sampler.phase_rows
    figures = [sampler_timeline(sampler)]
    figures += [heatmap_figure(rows, device) for device in dict.fromkeys(r["device"] for r in rows)]
    if history:
        figures.append(training_figure(history))
    parts = [pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figures)]
    leaks = sorted({d for r in history for d in r.leaks})
    summary = _summary_html(device_summary(rows, capacities_of(sampler)), leaks)
    settings = (
        f"<details><summary>config</summary><pre>{html.escape(yaml.safe_dump(config, sort_keys=False))}</pre></details>"
        if config
        else ""
    )
    last = (
        f"<h2>Per-phase memory, step {history[-1].step} (MiB)</h2>{_table_html(history[-1].memory)}"
        if history
        else _unfinished_table(rows)
    )
    # a run with tools: its calls and failures per step, under the reward and loss; on vllm its prefix cache's hits
    tools = tool_table(history)
    heading = "Tool calls per step" if tools and tools.title.startswith("tool") else "Prefix cache hits per step"
    tools = f"<h2>{heading}</h2>{tools.html()}" if tools is not None else ""
    body = f"<h1>{html.escape(title)}</h1>{summary}{settings}" + "".join(parts) + tools + last
    return atomic_write_text(
        path,
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"</head><body style='font-family:sans-serif'>{body}</body></html>",
    )
