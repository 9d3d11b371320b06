"""The report's figures: the memory timeline (labelled phase bands, step separators, limits that do not
stretch the axis), a phase x step heatmap of each device's peak above the phase's start, and reward/loss."""
from __future__ import annotations

from ..phases import COLOURS, PHASE_NAMES
from .probes import MiB

TIMELINE_METRICS = {"rss", "used", "allocated", "reserved", "device_used", "not_torch"}
FAR = 1.5            # a limit above FAR x the data's maximum is named in a corner instead of drawn
MIN_LABELLED = 0.02  # a phase band narrower than this share of the run gets no label (they would overlap)


def primary_metric(device: str, metrics) -> str:
    """The figure a device's peak is read from: the process's RSS on the host; on a GPU, NVML's device-wide
    used memory when known (what runs out), else torch's reserved."""
    if device == "host":
        return "rss"
    return "device_used" if "device_used" in metrics else "reserved"


def band_labels(marks) -> list[dict]:
    """Annotations naming each phase band wide enough to hold a label, and each step where it starts."""
    span = max((end for *_, end in marks), default=1.0) - min((start for _, _, start, _ in marks), default=0.0)
    out, seen = [], set()
    for step, phase, start, end in marks:
        if span and (end - start) / span >= MIN_LABELLED:
            out.append(dict(x=(start + end) / 2, y=1.0, yref="paper", text=phase, showarrow=False, textangle=-90,
                            yanchor="top", font=dict(size=10), name="band-label"))
        if step not in seen:
            seen.add(step)
            out.append(dict(x=start, y=0, yref="paper", text=f"step {step}", showarrow=False, xanchor="left",
                            yanchor="bottom", font=dict(size=10, color="#444"), name="step-label"))
    return out


def step_separators(marks) -> list[dict]:
    """A dotted vertical line where each step's first phase starts."""
    firsts = {}
    for step, _, start, _ in marks:
        firsts.setdefault(step, start)
    return [dict(type="line", xref="x", yref="paper", x0=x, x1=x, y0=0, y1=1,
                 line=dict(dash="dot", color="#666", width=1)) for x in firsts.values()]


def timeline_figure(samples, marks, limits: dict | None = None):
    """Memory over time, one line per device and metric; phases as labelled bands, steps separated."""
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
    top = max((max(ys) for _, ys in series.values() if ys), default=1.0)
    for _, phase, start, end in marks:
        fig.add_vrect(x0=start, x1=end, fillcolor=COLOURS.get(phase, "#cccccc"), opacity=0.15, line_width=0)
    for shape in step_separators(marks):
        fig.add_shape(shape)
    for label in band_labels(marks):
        fig.add_annotation(label)
    far = []
    for name, mib in (limits or {}).items():
        if mib <= FAR * top:
            fig.add_hline(y=mib, line_dash="dash", annotation_text=name, annotation_position="top left")
            top = max(top, mib)
        else:
            far.append(f"{name}: {mib:,.0f} MiB")
    if far:   # why: drawn, a 24 GB limit would flatten a 1 GB run along the bottom
        fig.add_annotation(x=1, y=1, xref="paper", yref="paper", xanchor="right", yanchor="bottom", showarrow=False,
                           text="off the scale: " + "; ".join(far), font=dict(size=10), name="far-limits")
    fig.update_yaxes(range=[0, top * 1.08])
    fig.update_layout(title="Memory timeline (MiB): phases shaded and labelled, steps separated", xaxis_title="seconds",
                      yaxis_title="MiB", height=460, margin=dict(t=70, l=50, r=20, b=40),
                      legend=dict(orientation="h", y=-0.2))
    return fig


def heatmap_figure(rows, device: str):
    """Peak above the phase's start (MiB) of `device`'s primary metric, phase x step: where each step grew."""
    import plotly.graph_objects as go

    mine = [r for r in rows if r["device"] == device]
    metric = primary_metric(device, {r["metric"] for r in mine})
    cells = {(r["phase"], r["step"]): (r["peak"] - r["start"]) / MiB for r in mine
             if r["metric"] == metric and not r.get("failed_attempt")}
    steps = sorted({s for _, s in cells})
    phases = [p for p in PHASE_NAMES if any((p, s) in cells for s in steps)]
    z = [[cells.get((p, s)) for s in steps] for p in phases]
    fig = go.Figure(go.Heatmap(z=z, x=steps, y=phases, colorscale="Reds", colorbar=dict(title="MiB"),
                               text=[[f"{v:.0f}" if v is not None else "" for v in row] for row in z],
                               texttemplate="%{text}", hovertemplate="step %{x}, %{y}: +%{z:.1f} MiB<extra></extra>"))
    fig.update_layout(title=f"{device}: {metric} peak above each phase's start (MiB)", xaxis_title="step",
                      yaxis=dict(autorange="reversed"), height=80 + 38 * max(len(phases), 1))
    fig.update_xaxes(type="category")
    return fig


def training_figure(history):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    steps = [r.step for r in history]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("reward (mean)", "loss"))
    fig.add_trace(go.Scatter(x=steps, y=[r.reward_mean for r in history], name="reward"), 1, 1)
    fig.add_trace(go.Scatter(x=steps, y=[r.loss for r in history], name="loss"), 1, 2)
    fig.update_layout(height=320, showlegend=False)
    fig.update_xaxes(tickmode="linear", dtick=max(1, len(steps) // 10), title_text="step")   # whole steps only
    return fig
