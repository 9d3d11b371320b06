"""The report's step figures: where each step grew (a phase x step heatmap of each device's peak above the phase's
start) and what it learned (reward and loss per step). The memory timeline is figures.py."""

from __future__ import annotations

from ..algo.phases import PHASE_NAMES
from .figures import primary_metric
from .readers import MiB


def heatmap_figure(rows, device: str):
    """Peak above the phase's start (MiB) of `device`'s primary metric, phase x step: where each step grew."""
    import plotly.graph_objects as go

    mine = [r for r in rows if r["device"] == device]
    metric = primary_metric(device, {r["metric"] for r in mine})
    cells = {
        (r["phase"], r["step"]): (r["peak"] - r["start"]) / MiB
        for r in mine
        if r["metric"] == metric and not r.get("failed_attempt")
    }
    steps = sorted({s for _, s in cells})
    phases = [p for p in PHASE_NAMES if any((p, s) in cells for s in steps)]
    z = [[cells.get((p, s)) for s in steps] for p in phases]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=steps,
            y=phases,
            colorscale="Reds",
            colorbar=dict(title="MiB"),
            text=[[f"{v:.0f}" if v is not None else "" for v in row] for row in z],
            texttemplate="%{text}",
            hovertemplate="step %{x}, %{y}: +%{z:.1f} MiB<extra></extra>",
        )
    )
    fig.update_layout(
        title=f"{device}: {metric} peak above each phase's start (MiB)",
        xaxis_title="step",
        yaxis=dict(autorange="reversed"),
        height=130 + 38 * max(len(phases), 1),
        margin=dict(t=50, b=50, l=90, r=20),
    )  # why fixed: plotly's default margins leave one row no room
    fig.update_xaxes(type="category")
    return fig


def training_figure(history):
    """Left: the total reward's mean with its spread (mean ± std over the step's completions) and each reward
    function's mean, named as TRL logs it (rewards/<name>/mean); right: the loss."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    steps = [r.step for r in history]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("reward: total (mean ± std) and each function's mean", "loss"))
    upper = [r.reward_mean + r.reward_std for r in history]
    lower = [r.reward_mean - r.reward_std for r in history]
    band = dict(mode="lines", line=dict(width=0), showlegend=False, hoverinfo="skip")
    fig.add_trace(go.Scatter(x=steps, y=upper, name="reward + std", **band), 1, 1)
    fig.add_trace(go.Scatter(x=steps, y=lower, name="reward - std", fill="tonexty", **band), 1, 1)
    fig.add_trace(go.Scatter(x=steps, y=[r.reward_mean for r in history], name="reward"), 1, 1)
    for name in dict.fromkeys(n for r in history for n in r.rewards):
        means = [r.rewards.get(name) for r in history]
        fig.add_trace(go.Scatter(x=steps, y=means, name=f"rewards/{name}/mean", line=dict(dash="dot")), 1, 1)
    fig.add_trace(go.Scatter(x=steps, y=[r.loss for r in history], name="loss", showlegend=False), 1, 2)
    fig.update_layout(height=360, legend=dict(orientation="h", y=-0.25))
    fig.update_xaxes(tickmode="linear", dtick=max(1, len(steps) // 10), title_text="step")  # whole steps only
    return fig
