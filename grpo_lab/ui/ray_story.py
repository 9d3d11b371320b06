"""Notebook 06's Ray figure: the machine's used RAM (what Ray's memory monitor reads) against Ray's kill line, one
panel per run, each rank's RSS beneath it, a rank that died marked where its samples end (`ray_run`, read from a
Lab's own samples before it closes)."""

from __future__ import annotations

import time
from typing import Optional

from ..memory.readers import MiB

GiB = 1024 * MiB
POINTS = 200  # a run's trace in the figure, at most (thinned)


def clock(lab) -> float:
    """Now on `lab`'s sampler clock (seconds since its sampler started): where a run starts."""
    return time.perf_counter() - lab.memory.t0


def ray_run(lab, since: float, died: Optional[int] = None) -> dict:
    """`lab`'s samples from `since` (its clock) on, in GiB over seconds from there: {"machine": (x, y), the driver's
    host `used` (the machine's used RAM, without placement.host_memory_gib), "ranks": {"rank<k>": (x, y)} each rank's
    RSS, "died": the rank that died, or None}."""
    series: dict[str, tuple[list, list]] = {}
    for t, _, _, device, metric, value in list(lab.memory.samples):
        if t < since:
            continue
        if (device, metric) == ("host", "used"):
            name = "machine"
        elif device.startswith("rank") and device.endswith("/host") and metric == "rss":
            name = device.split("/")[0]
        else:
            continue
        xs, ys = series.setdefault(name, ([], []))
        xs.append(round(t - since, 3))
        ys.append(value / GiB)
    series = {name: thinned(xs, ys) for name, (xs, ys) in series.items()}
    machine = series.pop("machine", ([], []))
    return {"machine": machine, "ranks": dict(sorted(series.items())), "died": died}


def thinned(xs: list, ys: list, most: int = POINTS) -> tuple[list, list]:
    """At most `most` points of a series, evenly, its last one kept (where a dead rank's samples end). Why: the figure
    is saved in the notebook, and every sample of a step at the sampler's rate made it megabytes."""
    stride = max(1, -(-len(xs) // most))
    keep = sorted({*range(0, len(xs), stride), len(xs) - 1}) if xs else []
    return [xs[i] for i in keep], [round(ys[i], 4) for i in keep]


def ray_line_figure(runs: dict[str, dict], line_gib: float):
    """One panel per run ({title: ray_run(...)}), side by side on one GiB axis: the machine's used RAM, each rank's
    RSS, Ray's kill line dashed, a dead rank's last sample marked with an x."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=len(runs), subplot_titles=list(runs), shared_yaxes=True, horizontal_spacing=0.06)
    colours = {"machine": "#1f77b4", "rank0": "#2ca02c", "rank1": "#ff7f0e", "rank2": "#9467bd", "rank3": "#8c564b"}
    for col, run in enumerate(runs.values(), start=1):
        first = col == 1
        x, y = run["machine"]
        fig.add_trace(
            go.Scatter(x=x, y=y, name="the machine's used RAM", line=dict(color=colours["machine"], width=2),
                       legendgroup="machine", showlegend=first),
            row=1, col=col,
        )  # fmt: skip
        for rank, (rx, ry) in run["ranks"].items():
            fig.add_trace(
                go.Scatter(x=rx, y=ry, name=f"{rank} RSS", line=dict(color=colours.get(rank, "#7f7f7f"), width=1),
                           legendgroup=rank, showlegend=first),
                row=1, col=col,
            )  # fmt: skip
            if run["died"] is not None and rank == f"rank{run['died']}" and rx:
                fig.add_trace(
                    go.Scatter(x=[rx[-1]], y=[ry[-1]], mode="markers+text", text=[f"{rank} killed"],
                               textposition="top center", marker=dict(symbol="x", size=12, color="#d62728"),
                               line=dict(color="#d62728"), name="killed by Ray's monitor", showlegend=False),
                    row=1, col=col,
                )  # fmt: skip
        fig.add_hline(y=line_gib, line=dict(dash="dash", color="#d62728", width=1), row=1, col=col)
        fig.update_xaxes(title_text="seconds into the step", row=1, col=col)
    fig.add_annotation(
        xref="paper", yref="y", x=0, y=line_gib, text=f"Ray's kill line {line_gib:.2f} GiB", showarrow=False,
        xanchor="left", yanchor="bottom", font=dict(size=10, color="#d62728"),
    )  # fmt: skip
    top = max([line_gib, *(v for run in runs.values() for v in run["machine"][1])])
    fig.update_yaxes(range=[0, top * 1.1])
    fig.update_yaxes(title_text="GiB", row=1, col=1)
    fig.update_layout(
        title="The machine's used RAM against Ray's kill line, and each rank's RSS",
        height=420,
        margin=dict(t=80, l=50, r=20, b=40),
        legend=dict(orientation="h", y=-0.25),
    )
    return fig
