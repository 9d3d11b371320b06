"""The report's figures: the memory timeline (labelled phase bands, step separators, limits that do not
stretch the axis), a phase x step heatmap of each device's peak above the phase's start, and reward/loss."""

from __future__ import annotations

from ..algo.phases import COLOURS, PHASE_NAMES
from .readers import MiB, is_host
from .tables import size_text

HOST_LINES = ("rss", "used")  # the process's RSS, the machine's used RAM
# a GPU's memory, stacked: sums to NVML's used (readers.gpu_ledger)
LEDGER = ("allocated", "cached", "engine", "not_torch")
LEDGER_NAMES = {
    "allocated": "torch allocated",
    "cached": "torch cache (reserved - allocated)",
    "engine": "vLLM engine (in this process)",
    "not_torch": "not torch (NVML used - the rest)",
}
# a limit above FAR x the data's maximum is named instead of drawn. Why 1.25: a 4,000 MiB line drawn over data under
# 2,100 flattened the curves into the bottom third of the plot
FAR = 1.25
UNDONE = "#d62728"  # a rolled-back attempt's band: red over its phase's colour
MIN_LABELLED = 0.02  # a phase band narrower than this share of the run gets no label (they would overlap)
MIN_STEP_GAP = 0.07  # step labels nearer than this share of the view overlap ("step 4step 5"): every n-th is labelled
# why this strong and under the traces: at 0.12 the bands were faint on a dark theme; drawn between the grid and the
# lines (plotly's layer "between"), a stronger tint never covers a line
BAND_OPACITY = 0.3


def primary_metric(device: str, metrics) -> str:
    """The figure a device's peak is read from: the process's RSS on the host; on a GPU, NVML's device-wide
    used memory when known (what runs out), else torch's reserved."""
    if is_host(device):
        return "rss"
    return "device_used" if "device_used" in metrics else "reserved"


def primary_rows(rows) -> list:
    """The rows (dicts with device and metric) of each device's primary metric, chosen from the metrics its rows
    have."""
    metrics_of: dict[str, set] = {}
    for r in rows:
        metrics_of.setdefault(r["device"], set()).add(r["metric"])
    return [r for r in rows if r["metric"] == primary_metric(r["device"], metrics_of[r["device"]])]


def drawn(device: str, metric: str) -> bool:
    """Whether the timeline and the live plot draw this series: lines on the host, the ledger on a GPU."""
    return metric in (HOST_LINES if is_host(device) else LEDGER)


def trace_style(device: str, metric: str) -> dict:
    """A GPU's ledger is a stack per device (what sits on top of torch's reserved is not torch's); host lines are
    lines."""
    if is_host(device):
        style = dict(name=f"{device} {metric}", mode="lines")
        if device.startswith("rank"):  # why dashes: ranks hold about the same, and a solid line hid the one under it
            rank = int(device[4 : device.index("/")])
            style["line"] = dict(dash=("solid", "dash", "dot", "dashdot")[rank % 4], width=2.5 if rank % 4 else 1.5)
        return style
    return dict(name=f"{device} {LEDGER_NAMES[metric]}", mode="lines", stackgroup=device, line=dict(width=0.5))


def band_labels(marks, low: bool = False) -> list[dict]:
    """Annotations naming each phase band wide enough to hold a label (at its top; `low`: at its bottom, each step's
    label at the top), and each step where it starts, but for a step that starts too close to the last labelled one
    (their labels would overlap)."""
    span = max((end for *_, end in marks), default=1.0) - min((start for _, _, start, _ in marks), default=0.0)
    labelled, _ = step_stride(marks)
    out, seen = [], set()
    for step, phase, start, end in marks:
        if span and (end - start) / span >= MIN_LABELLED:
            out.append(
                dict(
                    x=(start + end) / 2,
                    y=0.0 if low else 1.0,
                    yref="paper",
                    text=phase,
                    showarrow=False,
                    textangle=-90,
                    yanchor="bottom" if low else "top",
                    font=dict(size=10),
                    name="band-label",
                )
            )
        if step not in seen and step in labelled:
            seen.add(step)
            out.append(
                dict(
                    x=start,
                    y=1 if low else 0,
                    yref="paper",
                    text=f"step {step}",
                    showarrow=False,
                    xanchor="left",
                    yanchor="top" if low else "bottom",
                    font=dict(size=10),  # the layout's colour: a theme may set it
                    name="step-label",
                )
            )
    return out


def step_stride(marks) -> tuple[set, int]:
    """The steps that get a label, and n: every step, or every n-th from the first in view (the fewest left out) when
    neighbours' labels would be nearer than MIN_STEP_GAP of the view."""
    firsts: dict = {}
    for step, _, start, _ in marks:
        firsts.setdefault(step, start)
    span = max((end for *_, end in marks), default=1.0) - min(firsts.values(), default=0.0)
    steps = list(firsts)
    for n in range(1, len(steps) + 1):
        xs = [firsts[s] for s in steps[::n]]
        if not span or all((b - a) / span >= MIN_STEP_GAP for a, b in zip(xs, xs[1:])):
            return set(steps[::n]), n
    return set(steps[:1]), max(len(steps), 1)


def step_note(marks) -> str:
    """What a figure's title says when not every step is labelled: '  ·  every 2nd step labelled'."""
    _, n = step_stride(marks)
    return f"  ·  every {ordinal(n)} step labelled" if n > 1 else ""


def ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


IDLE_KEEP_S = 1.0  # an idle span between phases longer than this is drawn this wide (the live plot's x axis)
# a saved timeline's idle gap: this share of the run's working time wide (at least IDLE_KEEP_S), room for its label
IDLE_SHARE = 0.04
IDLE = "idle (squeezed)"  # the idle gaps' name in a key
IDLE_GREY = "#999999"


def idle_gaps(marks, now: float, keep_s: float = IDLE_KEEP_S) -> list[tuple[float, float]]:
    """The idle spans longer than `keep_s`: before the first phase (loading included), between two phases, after the
    last one until `now`."""
    gaps, last = [], 0.0
    for _, _, start, end in sorted(marks, key=lambda m: m[2]):
        if start - last > keep_s:
            gaps.append((last, start))
        last = max(last, end)
    if now - last > keep_s:
        gaps.append((last, now))
    return gaps


def work_clock(marks, now: float, keep_s: float = IDLE_KEEP_S):
    """x for a sample time t on a plot whose axis is working time: every idle span (idle_gaps) longer than `keep_s`
    is squeezed into `keep_s`, its samples spread evenly over it. Why: after minutes of reading a cell between
    steps, a plot in wall seconds shows each step as a sliver; this one keeps every step as wide as it ran, and idle
    stays visible as a narrow gap."""
    gaps = idle_gaps(marks, now, keep_s)

    def x(t: float) -> float:
        saved = 0.0
        for a, b in gaps:
            if t >= b:
                saved += (b - a) - keep_s
            elif t > a:
                return a - saved + (t - a) * keep_s / (b - a)
            else:
                break
        return t - saved

    return x


def idle_marks(gaps, clock, idle: str = "idle") -> tuple[list[dict], list[dict]]:
    """Each squeezed idle gap as a grey band (named: a key says what it is), its real length written in it (`idle`:
    what a gap holds, "other phases + idle" where the figure shows only some phases)."""
    shapes, notes = [], []
    for a, b in gaps:
        x0, x1, seconds = clock(a), clock(b), b - a
        shapes.append(band(x0, x1, IDLE_GREY, 0.2, IDLE))
        text = f"{'load + ' + idle if a <= 0 else idle} {seconds:,.{1 if seconds < 10 else 0}f} s"
        notes.append(dict(x=(x0 + x1) / 2, y=0.0, yref="paper", text=text, showarrow=False, textangle=-90))
        notes[-1].update(yanchor="bottom", font=dict(size=10), name="idle-label")
    return shapes, notes


def phase_key(phases) -> str:
    """The phases' colours as one line of text (a square in each colour, then its name), for a compact legend."""
    return "  ".join(f"<span style='color:{COLOURS.get(p, '#cccccc')}'>&#9632;</span> {p}" for p in phases)


def step_separators(marks) -> list[dict]:
    """A dotted vertical line where each step's first phase starts."""
    firsts = {}
    for step, _, start, _ in marks:
        firsts.setdefault(step, start)
    return [
        dict(type="line", xref="x", yref="paper", x0=x, x1=x, y0=0, y1=1, line=dict(dash="dot", color="#888", width=1))
        for x in firsts.values()
    ]


def band(x0: float, x1: float, colour: str, opacity: float, name: str) -> dict:
    """A shaded span of the x axis, the plot's full height: a phase, an idle gap, an undone attempt. Named: a saved
    figure's key (static.png) names each colour."""
    span = dict(type="rect", xref="x", yref="paper", x0=x0, x1=x1, y0=0, y1=1, line_width=0, layer="between")
    return span | dict(fillcolor=colour, opacity=opacity, name=name)


def turn_marks(segments, clock) -> tuple[list[dict], list[dict]]:
    """The marks inside phases (a tool loop's `turn 1`, `tools 1`, `turn 2`...: memory/sampler.py `mark`), each a
    dotted line where it starts and its name beside it, at the plot's top (shapes, annotations)."""
    shapes, notes = [], []
    for m in segments:
        if m.get("failed_attempt") is not None:
            continue
        x = clock(m["start"])
        line = dict(type="line", xref="x", yref="paper", x0=x, x1=x, y0=0, y1=0.93, name="turn-mark")
        shapes.append(line | dict(line=dict(color="#555555", width=1, dash="dot")))
        note = dict(x=x, y=0.93, xref="x", yref="paper", text=m["mark"], showarrow=False, xanchor="left")
        notes.append(note | dict(yanchor="top", textangle=-90, font=dict(size=9, color="#555555"), name="turn-mark"))
    return shapes, notes


def band_shapes(marks, opacity: float) -> list[dict]:
    """One shaded rectangle per phase (its colour), the plot's full height."""
    return [band(start, end, COLOURS.get(phase, "#cccccc"), opacity, phase) for _, phase, start, end in marks]


def phase_key_annotation(phases=PHASE_NAMES) -> dict:
    """The phases' colours in one row, above the plot at its right: the legend of the bands, labelled or not."""
    return dict(
        xref="paper",
        yref="paper",
        x=1,
        y=1.0,
        xanchor="right",
        yanchor="bottom",
        showarrow=False,
        text=phase_key(phases),
        font=dict(size=10),
        name="phase-key",
    )


def timeline_series(samples, clock) -> dict[tuple, tuple[list, list]]:
    """The drawn series, (device, metric) -> (x on `clock`, MiB)."""
    series: dict[tuple, tuple[list, list]] = {}
    for t, _, _, device, metric, value in samples:
        if drawn(device, metric):
            xs, ys = series.setdefault((device, metric), ([], []))
            xs.append(clock(t))
            ys.append(value / MiB)
    return series


def merge_twins(series: dict) -> dict[tuple, str]:
    """Drops a host's `used` line where it is its `rss` line, point for point (under placement.host_memory_gib `used`
    is the Lab's RSS: drawn twice, one line hid the other); returns the kept line's name, which says so."""
    names = {}
    for device in {d for d, _ in series if is_host(d)}:
        if (device, "used") in series and series.get((device, "rss")) == series[(device, "used")]:
            del series[(device, "used")]
            names[(device, "rss")] = f"{device} rss (= {device} used)"
    return names


def limit_parts(limits: dict, top: float) -> tuple[list, list, float]:
    """Limit lines near the data (FAR) with their names, one note naming the far ones, and the axis' new top. Why
    named: drawn, a 24 GB limit would flatten a 1 GB run along the bottom."""
    shapes, notes, far = [], [], []
    for name, mib in limits.items():
        if mib <= FAR * top:
            shapes.append(limit_line(mib, name))
            notes.append(limit_name(name, mib, right=True))  # why right: the step labels are at the top left
            top = max(top, mib)
        else:
            far.append(f"{name}: {size_text(mib * MiB)}")
    if far:
        note = dict(x=0, y=1, xref="paper", yref="paper", xanchor="left", yanchor="bottom", showarrow=False)
        notes.append(dict(note, text="off the scale: " + "; ".join(far), font=dict(size=10), name="far-limits"))
    return shapes, notes, top


def undone_parts(marks) -> tuple[list, list]:
    """A phase that was rolled back and run again (its `undone` marks): a red band over its own and the word
    "undone" at its top, so the figure shows the attempt the story undid beside the redo."""
    shapes = [band(start, end, UNDONE, 0.3, "undone attempt") for _, _, start, end in marks]
    notes = [
        dict(
            x=(start + end) / 2,
            y=0.93,  # why below the top: a step's label sits at the top, where an undone first phase begins
            yref="paper",
            text="undone",
            showarrow=False,
            yanchor="top",
            font=dict(size=10, color=UNDONE),
            name="band-label",
        )
        for _, _, start, end in marks
    ]
    return shapes, notes


def timeline_figure(samples, marks, limits: dict | None = None, undone=(), phases=None, segments=()):
    """Memory over time: host lines, each GPU's ledger stacked; phases as bands labelled at their foot (a key of
    their colours above; step labels and limit names at the top), steps separated; idle spans (loading too) squeezed
    to narrow grey gaps that say how long they were, so the axis shows work (the live plot's clock, wider gaps).
    Why shapes and annotations are assigned once: plotly's add_vrect / add_annotation copy the layout on every call,
    which took 12 s of a 25-step run's report. `phases`: those phases' samples and bands only (the title names them),
    the others squeezed as idle is. `segments`: the marks inside phases (a tool loop's turns), dotted lines."""
    import plotly.graph_objects as go

    if phases is not None:
        samples = [s for s in samples if s[2] in phases]
        marks, undone = [m for m in marks if m[1] in phases], [m for m in undone if m[1] in phases]
        segments = [m for m in segments if m["phase"] in phases]

    now = max((t for t, *_ in samples), default=0.0)
    keep = max(IDLE_KEEP_S, IDLE_SHARE * sum(end - start for *_, start, end in marks))
    clock, gaps = work_clock(marks, now, keep), idle_gaps(marks, now, keep)
    series = timeline_series(samples, clock)
    names = merge_twins(series)
    traces = []
    for key, (xs, ys) in sorted(series.items(), key=lambda kv: trace_order(*kv[0])):
        kind = go.Scattergl if is_host(key[0]) else go.Scatter  # why: WebGL traces cannot stack
        style = trace_style(*key)
        style["name"] = names.get(key, style["name"])
        traces.append(kind(x=xs, y=ys, **style))
    worked = [(step, phase, clock(start), clock(end)) for step, phase, start, end in marks]
    undone_shapes, undone_notes = undone_parts([(s, p, clock(a), clock(b)) for s, p, a, b in undone])
    idle, idle_notes = idle_marks(gaps, clock, "idle" if phases is None else "other phases + idle")
    used = sorted({phase for _, phase, _, _ in marks}, key=lambda p: PHASE_NAMES.index(p) if p in PHASE_NAMES else 99)
    lines, notes, top = limit_parts(limits or {}, stack_top(series))
    turn_shapes, turn_notes = turn_marks(segments, clock)
    shapes = band_shapes(worked, opacity=BAND_OPACITY) + undone_shapes + idle + step_separators(worked) + lines
    shapes, notes = shapes + turn_shapes, notes + turn_notes
    squeezed = f"seconds of work: idle over {keep:.1f} s squeezed to {keep:.1f} s grey gaps, labelled with its length"
    axis = squeezed if gaps else "seconds"
    return go.Figure(
        data=traces,
        layout=dict(
            title=(
                "Memory timeline (MiB): phases shaded and labelled, steps separated"
                + ("" if phases is None else f"  ·  phases: {', '.join(phases)}")
                + step_note(worked)
            ),
            xaxis_title=axis,
            yaxis=dict(title="MiB", range=[0, top * 1.08]),
            height=460,
            margin=dict(t=80, l=50, r=20, b=40),
            legend=dict(orientation="h", y=-0.2),
            shapes=shapes,
            annotations=[phase_key_annotation(used or PHASE_NAMES)]
            + band_labels(worked, low=True)
            + undone_notes
            + idle_notes
            + notes,
        ),
    )


def limit_line(mib: float, name: str = "") -> dict:
    """A limit (a capacity, the host threshold) as a dashed line across the plot."""
    return dict(
        type="line",
        xref="paper",
        yref="y",
        x0=0,
        x1=1,
        y0=mib,
        y1=mib,
        line=dict(dash="dash", width=1, color="#888"),
        name=name,
    )


def limit_name(name: str, mib: float, right: bool = False) -> dict:
    """A limit line's name and size (size_text: as the plan writes it), just above it at the left (or the right)."""
    return dict(
        xref="paper",
        x=1 if right else 0,
        y=mib,
        yref="y",
        text=f"{name}: {size_text(mib * MiB)}",
        showarrow=False,
        xanchor="right" if right else "left",
        yanchor="bottom",
        font=dict(size=10),
    )


def trace_order(device: str, metric: str) -> tuple:
    """Host first; a GPU's ledger bottom-up (a stack is drawn in trace order)."""
    return (not is_host(device), device, LEDGER.index(metric) if metric in LEDGER else 0)


def stack_top(series: dict) -> float:
    """The highest point drawn (MiB): a host line's maximum, or a GPU stack's highest sum."""
    top = max((max(ys) for (d, _), (_, ys) in series.items() if is_host(d) and ys), default=1.0)
    for gpu in {d for d, _ in series if not is_host(d)}:
        columns = [ys for (d, _), (_, ys) in series.items() if d == gpu]
        top = max(top, max((sum(c) for c in zip(*columns)), default=0.0))
    return top
