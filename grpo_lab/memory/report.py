"""Run reports: DIR/memory.csv (every sample, with step and phase) and a self-contained
DIR/report.html (memory timeline with phase bands, per-phase peaks per step, reward and loss)."""
from __future__ import annotations

import csv
import io
from pathlib import Path

from ..io import atomic_write_text
from ..phases import COLOURS
from .probes import MiB

CSV_HEADER = ["seconds", "step", "phase", "device", "metric", "bytes"]
TIMELINE_METRICS = {"rss", "used", "allocated", "reserved", "device_used", "not_torch"}


class CsvStream:
    """Appends the sampler's new samples to memory.csv; call `flush()` after each step. A resumed run
    (`keep_before`: the step it resumes at) keeps the earlier steps' rows and goes on after their time."""

    def __init__(self, path: Path, sampler, keep_before: int | None = None):
        self.path, self.sampler, self.index = Path(path), sampler, 0   # from the first sample: loading included
        kept = _rows_before(self.path, keep_before) if keep_before else []
        self.offset = max((float(r[0]) for r in kept), default=0.0)
        self.floor = keep_before or 0   # why: a resumed process's loading samples belong to its first step, not to step 0
        buffer = io.StringIO()
        csv.writer(buffer).writerows([CSV_HEADER, *kept])
        atomic_write_text(self.path, buffer.getvalue())

    def flush(self) -> None:
        rows = self.sampler.samples_since(self.index)
        self.index += len(rows)
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerows((f"{t + self.offset:.4f}", max(step, self.floor), phase, dev, metric, int(v))
                                    for t, step, phase, dev, metric, v in rows)


def _rows_before(path: Path, step: int) -> list[list[str]]:
    """The complete rows of steps before `step` (a row cut short by a kill is dropped)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))[1:]
    except OSError:
        return []
    return [r for r in rows if len(r) == len(CSV_HEADER) and r[1].isdigit() and int(r[1]) < step and r[5].isdigit()]


def timeline_figure(samples, marks, limits: dict | None = None):
    """Memory over time, one line per device and metric, phases as shaded bands."""
    import plotly.graph_objects as go

    series: dict[tuple, tuple[list, list]] = {}
    for t, _, _, device, metric, value in samples:
        if metric in TIMELINE_METRICS:
            xs, ys = series.setdefault((device, metric), ([], []))
            xs.append(t)
            ys.append(value / MiB)
    fig = go.Figure()
    for (device, metric), (xs, ys) in series.items():
        fig.add_trace(go.Scattergl(x=xs, y=ys, mode="lines", name=f"{device} {metric}"))
    for step, phase, start, end in marks:
        fig.add_vrect(x0=start, x1=end, fillcolor=COLOURS.get(phase, "#cccccc"), opacity=0.12, line_width=0)
    for name, mib in (limits or {}).items():
        fig.add_hline(y=mib, line_dash="dash", annotation_text=name, annotation_position="top left")
    fig.update_layout(title="Memory timeline (MiB); bands: " + ", ".join(COLOURS), xaxis_title="seconds",
                      yaxis_title="MiB", height=420, margin=dict(t=50, l=50, r=20, b=40))
    return fig


def phase_peaks_figure(rows):
    """Peak of each phase per step, one line per phase x device x metric."""
    import plotly.graph_objects as go

    series: dict[tuple, tuple[list, list]] = {}
    for r in rows:
        xs, ys = series.setdefault((r["phase"], r["device"], r["metric"]), ([], []))
        xs.append(r["step"])
        ys.append(r["peak"] / MiB)
    fig = go.Figure([go.Scatter(x=xs, y=ys, mode="lines+markers", name=" ".join(key))
                     for key, (xs, ys) in series.items()])
    fig.update_layout(title="Per-phase peak memory per step (MiB)", xaxis_title="step", yaxis_title="MiB", height=380)
    return fig


def training_figure(history):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    steps = [r.step for r in history]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("reward (mean)", "loss"))
    fig.add_trace(go.Scatter(x=steps, y=[r.reward_mean for r in history], name="reward"), 1, 1)
    fig.add_trace(go.Scatter(x=steps, y=[r.loss for r in history], name="loss"), 1, 2)
    fig.update_layout(height=320, showlegend=False)
    return fig


def host_limits(sampler) -> dict[str, float]:
    """Capacity and threshold lines for the plots (MiB)."""
    host = sampler.latest("host")
    limits = {"host limit": host["limit"] / MiB, f"host threshold {sampler.host_threshold:.0%}":
              host["limit"] * sampler.host_threshold / MiB}
    for probe in sampler.probes[1:]:
        limits[f"{probe.device} capacity"] = probe.total / MiB
    return limits


def write_report(path: Path, sampler, history, title: str = "grpo_lab run") -> Path:
    """A self-contained HTML file (plotly.js inlined once)."""
    import html

    import plotly.io as pio

    from .sampler import format_table

    figures = [timeline_figure(list(sampler.samples), sampler.marks, host_limits(sampler)),
               phase_peaks_figure(sampler.phase_rows)]
    if history:
        figures.append(training_figure(history))
    parts = [pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figures)]
    leaks = sorted({d for r in history for d in r.leaks})
    leak_line = (f"<p><b>Leak detector:</b> after-step memory kept rising on {', '.join(leaks)}.</p>" if leaks
                 else "<p><b>Leak detector:</b> no device flagged.</p>")
    last = f"<h2>Per-phase memory, step {history[-1].step} (MiB)</h2><pre>{html.escape(format_table(history[-1].memory))}</pre>" if history else ""
    body = f"<h1>{html.escape(title)}</h1>{leak_line}" + "".join(parts) + last
    return atomic_write_text(path, f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                                   f"</head><body style='font-family:sans-serif'>{body}</body></html>")
