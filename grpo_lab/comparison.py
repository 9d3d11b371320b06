"""Run-to-run comparison: one self-contained HTML page that overlays several runs' per-phase memory peaks
per device and their reward/loss curves, each run labelled by what differs in its config from the others
(`grpo-lab compare DIR DIR ...`, `grpo_lab.compare([...])`, and the sweep's compare.html).

A run that failed (out of memory included) is compared too: its finished steps from metrics.jsonl, the
failing step's phases from memory.csv, and where it failed."""

from __future__ import annotations

import csv
import html
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import yaml

from .algo.phases import PHASE_NAMES
from .errors import LabError
from .files import atomic_write_text
from .memory.figures import primary_rows
from .memory.readers import MiB
from .recovery.rundir import CONFIG, METRICS, complete_lines, read_status

IGNORED = {"run.output_dir"}  # why: differs between any two runs and says nothing about them
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")


@dataclass
class RunRecord:
    """What a comparison reads of one run."""

    name: str  # the directory (or sweep point) name
    config: dict = field(default_factory=dict)  # the resolved config, {section: {field: value}}
    metrics: list[dict] = field(default_factory=list)  # one dict per finished step (metrics.jsonl)
    failed_rows: list[dict] = field(default_factory=list)  # per-phase peaks of a step that did not finish
    status: str = "finished"  # finished, failed, unfinished
    error: str = ""
    label: str = ""  # filled by `label_runs` unless given


def load_run(path: Union[str, Path]) -> RunRecord:
    """A run directory `grpo-lab run` wrote (config.yaml, metrics.jsonl, memory.csv, run.json)."""
    import json

    path = Path(path)
    if not path.is_dir() or not ((path / CONFIG).is_file() or (path / METRICS).is_file()):
        why = "no such directory" if not path.exists() else f"no {CONFIG} or {METRICS}"
        raise LabError(f"compare: {str(path)!r} holds no grpo_lab run ({why}); give directories `grpo-lab run` wrote")
    try:
        config = yaml.safe_load((path / CONFIG).read_text()) if (path / CONFIG).is_file() else {}
    except yaml.YAMLError as err:
        raise LabError(
            f"compare: {str(path / CONFIG)!r} is not valid YAML ({str(err).splitlines()[0]}); "
            "restore the file the run wrote"
        ) from None
    metrics = [json.loads(line) for line in complete_lines(path / METRICS)]
    info = read_status(path)
    status = {"finished": "finished", "failed": "failed"}.get(info.get("status"), "unfinished")
    failed = _unfinished_step_rows(path / "memory.csv", len(metrics)) if status != "finished" else []
    return RunRecord(
        path.name, config if isinstance(config, dict) else {}, metrics, failed, status, info.get("error", "")
    )


def _unfinished_step_rows(csv_path: Path, step: int) -> list[dict]:
    """Per-phase peaks (primary metric) of the step after the last finished one, from the run's samples:
    a failed run's last step is in memory.csv only. Rows are in the order the phases ran."""
    try:
        with open(csv_path, newline="") as f:
            samples = [
                r
                for r in csv.DictReader(f)
                if r.get("step") == str(step) and r.get("phase") in PHASE_NAMES and (r.get("bytes") or "").isdigit()
            ]
    except OSError:
        return []
    peaks: dict[tuple, dict] = {}
    for r in primary_rows(samples):
        row = peaks.setdefault((r["phase"], r["device"], r["metric"]), {"start": int(r["bytes"]), "peak": 0})
        row["peak"] = max(row["peak"], int(r["bytes"]))
    return [{"step": step, "phase": p, "device": d, "metric": m, **v} for (p, d, m), v in peaks.items()]


def flatten(config: dict) -> dict[str, object]:
    return {
        f"{section}.{name}": value
        for section, fields in config.items()
        if isinstance(fields, dict)
        for name, value in fields.items()
    }


def config_differences(runs: Sequence[RunRecord]) -> list[str]:
    """The dotted fields whose values are not the same in every run (a field a run lacks counts as differing)."""
    flat = [flatten(r.config) for r in runs]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    missing = object()
    return [k for k in keys if k not in IGNORED and len({repr(f.get(k, missing)) for f in flat}) > 1]


def label_runs(runs: Sequence[RunRecord]) -> list[RunRecord]:
    """Give each run without a label one: the values of the fields that differ, else its name; unique."""
    differing = config_differences(runs)
    seen: dict[str, int] = {}
    for run in runs:
        if not run.label:
            flat = flatten(run.config)
            run.label = ", ".join(f"{k}={flat.get(k, '-')}" for k in differing) or run.name
        seen[run.label] = seen.get(run.label, 0) + 1
    for run in runs:
        if seen[run.label] > 1:  # why: same config twice (a re-run): the directory tells them apart
            run.label = f"{run.label} ({run.name})"
    return list(runs)


def phase_peaks(run: RunRecord, rise: bool = False) -> dict[tuple[str, str], dict[str, float]]:
    """{(device, metric): {phase: bytes}} of each device's primary metric, the most over every step of the run
    (failed attempts left out; the failing step's phases included): the peak, or with `rise` the peak above
    the phase's start (what the phase itself added)."""
    need = ("device", "metric", "phase", "peak", "start") if rise else ("device", "metric", "phase", "peak")
    rows = [r for m in run.metrics for r in m.get("memory", []) if not r.get("failed_attempt")] + run.failed_rows
    rows = [r for r in rows if all(k in r for k in need)]  # why: a sweep notebook may save rows of its own making
    out: dict[tuple[str, str], dict[str, float]] = {}
    for r in primary_rows(rows):
        phases = out.setdefault((r["device"], r["metric"]), {})
        value = r["peak"] - r["start"] if rise else r["peak"]
        phases[r["phase"]] = max(phases.get(r["phase"], value), value)
    return out


def where_it_failed(run: RunRecord) -> str:
    if run.status == "finished":
        return ""
    last = run.failed_rows[-1]["phase"] if run.failed_rows else None
    at = f" in {last} of step {len(run.metrics)}" if last else f" after {len(run.metrics)} steps"
    return f"{run.status}{at}" + (f": {run.error}" if run.error else "")


def memory_figure(runs: Sequence[RunRecord]):
    """Grouped bars, per device two panels (the peak, what OOMs; the rise above each phase's start, where the
    runs differ), per phase a group, per run a bar (the same colour in every figure)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    panels = [(False, "peak per phase"), (True, "peak above the phase's start (what the phase added)")]
    peaks = {rise: [phase_peaks(r, rise) for r in runs] for rise, _ in panels}
    devices = list(dict.fromkeys(d for p in peaks[False] for d in p))  # (device, metric)
    titles = [f"{d}: {m} {what} (MiB)" for d, m in devices for _, what in panels]
    rows = max(len(titles), 1)
    fig = make_subplots(rows=rows, cols=1, vertical_spacing=0.25 / rows, subplot_titles=titles or [""])
    for i, (device, (rise, _)) in enumerate(((d, panel) for d in devices for panel in panels), start=1):
        phases = [p for p in PHASE_NAMES if any(p in pk.get(device, {}) for pk in peaks[False])]
        for j, (run, pk) in enumerate(zip(runs, peaks[rise])):
            mine = pk.get(device, {})
            fig.add_trace(
                go.Bar(
                    x=phases,
                    y=[mine[p] / MiB if p in mine else None for p in phases],
                    name=run.label,
                    legendgroup=run.label,
                    showlegend=i == 1,
                    marker_color=PALETTE[j % len(PALETTE)],
                    hovertemplate="%{fullData.name}<br>%{x}: %{y:,.1f} MiB<extra></extra>",
                ),
                row=i,
                col=1,
            )
    height, top, bottom = 130 + 260 * rows, 120, 40
    fig.update_layout(
        barmode="group",
        height=height,
        title="Per-phase memory per device",
        legend=dict(orientation="h", y=1 + 30 / (height - top - bottom), yanchor="bottom", x=0),
        margin=dict(t=top, l=60, r=20, b=bottom),
    )  # legend between the title and the first panel
    return fig


DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
MARKERS = ("circle", "square", "diamond", "triangle-up", "x", "star")


def training_figure(runs: Sequence[RunRecord]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("reward (mean)", "loss"))
    for j, run in enumerate(runs):
        steps = [m["step"] for m in run.metrics]
        colour = PALETTE[j % len(PALETTE)]
        for col, key in ((1, "reward_mean"), (2, "loss")):
            # why a dash and a marker per run as well as a colour: runs with identical curves would draw one line
            fig.add_trace(
                go.Scatter(
                    x=steps,
                    y=[m.get(key) for m in run.metrics],
                    mode="lines+markers",
                    name=run.label,
                    legendgroup=run.label,
                    showlegend=col == 1,
                    line=dict(color=colour, dash=DASHES[j % len(DASHES)], width=2 + (j == 0)),
                    marker=dict(symbol=MARKERS[j % len(MARKERS)], size=8),
                ),
                1,
                col,
            )
    fig.update_layout(height=360, title="Reward and loss per step", legend=dict(orientation="h", y=-0.25))
    fig.update_xaxes(
        title_text="step", tickmode="linear", dtick=max(1, max((len(r.metrics) for r in runs), default=1) // 10)
    )
    return fig


def _runs_table(runs: Sequence[RunRecord]) -> str:
    peaks_of = [phase_peaks(r) for r in runs]
    devices = list(dict.fromkeys(d for peaks in peaks_of for d in peaks))  # (device, metric)
    head = "".join(
        f"<th>{h}</th>"
        for h in [
            "run",
            "label",
            "status",
            "steps",
            "s/step (median)",
            "last reward",
            *[f"{html.escape(d)} {m} peak (phase)" for d, m in devices],
        ]
    )
    body = []
    for r, peaks in zip(runs, peaks_of):
        seconds = [m["step_seconds"] for m in r.metrics if m.get("step_seconds") is not None]
        cells = [
            r.name,
            r.label,
            where_it_failed(r) or r.status,
            str(len(r.metrics)),
            f"{statistics.median(seconds):.2f}" if seconds else "-",
            f"{r.metrics[-1]['reward_mean']:.3f}"
            if r.metrics and r.metrics[-1].get("reward_mean") is not None
            else "-",
        ]
        for d in devices:
            mine = peaks.get(d, {})
            top = max(mine, key=mine.get, default=None)
            cells.append(f"{mine[top] / MiB:,.0f} MiB ({top})" if top else "-")
        body.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return f"<table class='runs' border='1' cellspacing='0' cellpadding='3'><tr>{head}</tr>{''.join(body)}</table>"


def _differences_table(runs: Sequence[RunRecord]) -> str:
    keys = config_differences(runs)
    if not keys:
        return "<p class='differences'>The runs' configs are the same (apart from run.output_dir).</p>"
    head = "<th>field</th>" + "".join(f"<th>{html.escape(r.name)}</th>" for r in runs)
    body = "".join(
        "<tr><td>"
        + html.escape(k)
        + "</td>"
        + "".join(f"<td>{html.escape(str(flatten(r.config).get(k, '-')))}</td>" for r in runs)
        + "</tr>"
        for k in keys
    )
    return f"<table class='differences' border='1' cellspacing='0' cellpadding='3'><tr>{head}</tr>{body}</table>"


def compare_html(runs: Sequence[RunRecord], title: str = "grpo_lab: compare runs") -> str:
    import plotly.io as pio

    runs = label_runs(runs)
    figures = [memory_figure(runs), training_figure(runs)]
    parts = [pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figures)]
    body = (
        f"<h1>{html.escape(title)}</h1><h2>Runs</h2>{_runs_table(runs)}"
        f"<h2>What differs in their configs</h2>{_differences_table(runs)}" + "".join(parts)
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body style='font-family:sans-serif'>{body}</body></html>"
    )


def compare(
    runs: Sequence[Union[str, Path, RunRecord]], out: Union[str, Path] = "compare.html", title: Optional[str] = None
) -> Path:
    """Write the comparison page of `runs` (run directories or RunRecords) to `out`; returns its path."""
    if len(runs) < 2:
        raise LabError(
            f"compare: got {len(runs)} run{'s' if len(runs) != 1 else ''}; give at least two run directories"
        )
    records = [r if isinstance(r, RunRecord) else load_run(r) for r in runs]
    out = Path(out)
    if out.is_dir():
        raise LabError(
            f"--out: {str(out)!r} is a directory; give the path of the HTML file to write, e.g. {out / 'compare.html'}"
        )
    from .checks.paths import check_output_dir

    check_output_dir(out.parent if str(out.parent) else Path("."), "--out")
    written = atomic_write_text(
        out, compare_html(records, title or "grpo_lab: compare " + ", ".join(r.name for r in records))
    )
    return written.resolve()  # why absolute: the path is printed for a browser, from wherever the command ran
