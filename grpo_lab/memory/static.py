"""A plotly figure as a PNG, drawn by matplotlib: what a saved notebook, a papermill sweep's output or GitHub shows
where the live figure (JavaScript) is blank. Why not plotly's own image export: it needs kaleido and a Chrome.

It draws what grpo_lab's figures use: line and bar traces (stacked fills included), heatmaps, rectangles and lines
given in data or paper coordinates (phase bands, limit lines), the title and the axis titles.
"""

from __future__ import annotations

import io
import re
import textwrap

DPI = 100
# where plotly's paper (0..1, the plot area) sits on the canvas: left and bottom margins, then width and height
PAPER = (0.07, 0.12, 0.88, 0.72)


def _get(obj, *path, default=None):
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)
        if obj is None:
            return default
    return obj


def _text(title) -> str:
    """A title's text, plotly's HTML (<br>, <sup>, <b>) read as plain lines."""
    text = (title.get("text") if isinstance(title, dict) else title) or ""
    plain = re.sub(r"<[^>]+>", "", text.replace("<br>", "\n"))
    return "\n".join(textwrap.fill(line, 110) for line in plain.splitlines())


def _colour(value, default=None):
    """plotly's colour strings matplotlib reads as they are ('#rgb', names) or as rgba() tuples."""
    if not isinstance(value, str) or not value.startswith("rgb"):
        return value or default
    parts = [float(p) for p in value[value.index("(") + 1 : value.index(")")].split(",")]
    return tuple([c / 255 for c in parts[:3]] + parts[3:4])


def _scatter(ax, trace, below: dict) -> None:
    xs, ys = list(trace.get("x") or []), list(trace.get("y") or [])
    line = trace.get("line") or {}
    style = dict(label=trace.get("name"), color=_colour(line.get("color")), linewidth=line.get("width") or 1.5)
    style["linestyle"] = {"dash": "--", "dot": ":", "dashdot": "-."}.get(line.get("dash"), "-")
    mode = trace.get("mode") or "lines"
    if trace.get("stackgroup"):  # why: the GPU ledger's layers stack to the device's used memory
        group = trace["stackgroup"]
        base = below.get(group, [0.0] * len(ys))
        base = base if len(base) == len(ys) else [0.0] * len(ys)
        top = [b + y for b, y in zip(base, ys)]
        ax.fill_between(xs, base, top, alpha=0.5, color=style["color"], label=style["label"], linewidth=0)
        below[group] = top
        return
    if "markers" in mode and "lines" not in mode:
        ax.plot(xs, ys, "o", label=style["label"], color=style["color"])
    else:
        ax.plot(xs, ys, marker="o" if "markers" in mode else None, **style)


def _bar(ax, trace, offset: float, width: float) -> None:
    xs, ys = [str(x) for x in trace.get("x") or []], list(trace.get("y") or [])
    positions = [i + offset for i in range(len(xs))]
    colour = _colour(_get(trace, "marker", "color"))
    ax.bar(positions, ys, width=width, label=trace.get("name"), color=colour)
    ax.set_xticks(range(len(xs)), xs)


def _heatmap(ax, trace, fig) -> None:
    z = [[float("nan") if v is None else v for v in row] for row in trace.get("z") or []]
    limits = dict(vmin=trace.get("zmin"), vmax=trace.get("zmax"))
    image = ax.imshow(z, aspect="auto", origin="lower", cmap="RdYlGn_r", **limits)
    xs, ys = trace.get("x"), trace.get("y")
    if xs is not None:
        ax.set_xticks(range(len(xs)), [str(x) for x in xs], rotation=60, fontsize=7)
    if ys is not None:
        ax.set_yticks(range(len(ys)), [str(y) for y in ys], fontsize=7)
    if trace.get("showscale", True):
        fig.colorbar(image, ax=ax)


def _on_canvas(x: float, y: float) -> tuple[float, float]:
    """A point in plotly's paper coordinates, in the canvas's (PAPER)."""
    left, bottom, width, height = PAPER
    return left + width * x, bottom + height * y


def _axes(canvas, layout: dict, panel: str, column: int, count: int):
    """The panel's axes where plotly's layout puts them (its x and y domains), else side by side."""
    suffix = panel[1:]
    x_domain = _get(layout, f"xaxis{suffix}", "domain")
    anchor = _get(layout, f"xaxis{suffix}", "anchor", default=f"y{suffix}")
    y_domain = _get(layout, f"yaxis{anchor[1:]}", "domain")
    if not x_domain or not y_domain:
        return canvas.add_subplot(1, count, column + 1)
    (left, bottom), (right, top) = _on_canvas(x_domain[0], y_domain[0]), _on_canvas(x_domain[1], y_domain[1])
    return canvas.add_axes((left, bottom, right - left, top - bottom))


def _shape(ax, shape) -> None:
    kind = shape.get("type")
    colour = _colour(shape.get("fillcolor") or _get(shape, "line", "color"), "#888888")
    if kind == "rect" and shape.get("yref") == "paper":  # a phase band: its x range, the plot's full height
        ax.axvspan(shape["x0"], shape["x1"], color=colour, alpha=shape.get("opacity") or 0.15, linewidth=0)
    elif kind == "line" and shape.get("xref") == "paper":  # a limit: across the plot at its y
        ax.axhline(shape["y0"], color=colour, linestyle="--", linewidth=1)
        if shape.get("name"):
            ax.annotate(shape["name"], (0.005, shape["y0"]), xycoords=("axes fraction", "data"), fontsize=8)
    elif kind == "line" and shape.get("yref") == "paper":  # a step separator
        ax.axvline(shape["x0"], color=colour, linewidth=0.8)


def _panel(ax, traces, canvas) -> None:
    bars = [t for t in traces if t.get("type") == "bar"]
    below: dict = {}
    for trace in traces:
        kind = trace.get("type", "scatter")
        if kind in ("scatter", "scattergl"):
            _scatter(ax, trace, below)
        elif kind == "bar":
            index = bars.index(trace)
            width_each = 0.8 / len(bars)
            _bar(ax, trace, (index - (len(bars) - 1) / 2) * width_each, width_each)
        elif kind == "heatmap":
            _heatmap(ax, trace, canvas)


def png(fig, width: int = 900, height: int = None) -> bytes:
    """`fig` (a plotly Figure or its dict) as PNG bytes, `width` x its own height (or 420) pixels."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure  # why the class, not pyplot: no global figure state in the user's kernel

    data = fig.to_dict() if hasattr(fig, "to_dict") else fig
    layout = data.get("layout", {})
    height = height or layout.get("height") or 420
    canvas = Figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    traces = data.get("data", [])
    panels = list(dict.fromkeys(t.get("xaxis") or "x" for t in traces)) or ["x"]  # subplots side by side
    placed = len(panels) > 1 and _get(layout, "xaxis", "domain") is not None
    for column, panel in enumerate(panels):
        ax = _axes(canvas, layout, panel, column, len(panels)) if placed else canvas.add_subplot(1, 1, 1)
        mine = [t for t in traces if (t.get("xaxis") or "x") == panel]
        _panel(ax, mine, canvas)
        suffix = panel[1:]
        for shape in layout.get("shapes") or []:
            if (shape.get("xref") or "x") in (panel, "paper"):
                _shape(ax, shape)
        y_range = _get(layout, f"yaxis{suffix}", "range")
        if y_range:
            ax.set_ylim(*y_range)
        ax.set_xlabel(_text(_get(layout, f"xaxis{suffix}", "title")))
        ax.set_ylabel(_text(_get(layout, f"yaxis{suffix}", "title")))
        if any(t.get("name") and t.get("showlegend", True) for t in mine if t.get("type") != "heatmap"):
            ax.legend(fontsize=8, loc="best")
        ax.grid(alpha=0.3)
    for note in layout.get("annotations") or []:  # subplot titles and other notes placed on the page
        if note.get("xref") == "paper" and note.get("yref") == "paper" and placed:
            x, y = _on_canvas(note["x"], note["y"])
            canvas.text(x, y + 0.01, _text(note.get("text")), fontsize=8, ha="center")
    canvas.suptitle(_text(layout.get("title")), fontsize=9)
    if not placed:
        canvas.tight_layout()
    out = io.BytesIO()
    canvas.savefig(out, format="png")
    return out.getvalue()


def show(fig, width: int = 900) -> None:
    """Display a plotly figure live where plotly renders and as a PNG everywhere else (one output, both forms)."""
    from IPython.display import display

    data = fig.to_dict()  # why once: the PNG and the live figure are drawn from the same copy of the figure
    title = _text(_get(data, "layout", "title")) or "figure"
    display({"image/png": png(data, width), "text/plain": title, "application/vnd.plotly.v1+json": data}, raw=True)
