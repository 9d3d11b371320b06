"""A plotly figure as a PNG, drawn by matplotlib: what a saved notebook, a papermill sweep's output or GitHub shows
where the live figure (JavaScript) is blank. Why not plotly's own image export: it needs kaleido and a Chrome.

It draws what grpo_lab's figures use: line and bar traces (stacked fills included), heatmaps, rectangles and lines
given in data or paper coordinates (phase bands, limit lines), annotations (band labels, limit names), the title and
the axis titles; named bands (a phase, idle) become a key of their colours. A title's hover hint is left out: a PNG
has no hover.

Theme: a PNG has none of its own. Its background is transparent and its text, axes and grid one mid grey (INK: about
4.3:1 on white and on JupyterLab Dark's #111), so the same image reads in a light or a dark JupyterLab, VS Code,
GitHub and nbviewer. Why not a light and a dark image picked by CSS (body[data-jp-theme-light]): JupyterLab's
sanitizer strips <style> from an untrusted (saved) notebook's HTML, and plotly's renderer (rank 2, safe) shows our
image/png ahead of any HTML, trusted or not. `show()` gives the live figure the same transparent look.
"""

from __future__ import annotations

import io
import re
import textwrap

DPI = 100
# why 780 px: JupyterLab's output area is about 830 px wide at its default layout, and plotly's renderer shows the PNG
# at its pixel size (no max-width), so a wider one overflows it
WIDTH = 780
# where plotly's paper (0..1, the plot area) sits on the canvas: left and bottom margins, then width and height
PAPER = (0.07, 0.12, 0.88, 0.72)
INK = "#7a7a7a"  # text, ticks, spines: readable on a light and on a dark background (see the module's docstring)
GRID = (0.5, 0.5, 0.5, 0.25)
CLEAR = "rgba(0,0,0,0)"
HOVER_HINT = re.compile(r"[;,.]?\s*\bhover\b[^<\n]*", re.I)  # "...; hover a cell for its device" up to a tag
ANCHORS = {"left": "left", "right": "right", "top": "top", "bottom": "bottom", "middle": "center"}


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
    return "\n".join(textwrap.fill(line, 100) for line in plain.splitlines())


def _title(title) -> str:
    """The figure's title without its hover hint (nothing hovers in a PNG)."""
    text = (title.get("text") if isinstance(title, dict) else title) or ""
    return _text(HOVER_HINT.sub("", text))


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


def _heatmap(ax, trace, fig, placed: bool) -> None:
    z = [[float("nan") if v is None else v for v in row] for row in trace.get("z") or []]
    limits = dict(vmin=trace.get("zmin"), vmax=trace.get("zmax"))
    image = ax.imshow(z, aspect="auto", origin="lower", cmap="RdYlGn_r", **limits)
    xs, ys = trace.get("x"), trace.get("y")
    if xs is not None:
        ax.set_xticks(range(len(xs)), [str(x) for x in xs], rotation=60, fontsize=7)
    if ys is not None:
        ax.set_yticks(range(len(ys)), [str(y) for y in ys], fontsize=7)
    _cell_texts(ax, z, trace.get("texttemplate"), trace.get("text"))
    if trace.get("showscale", True):  # why at the page's right when placed: beside one panel it covers the next one
        beside = fig.add_axes((PAPER[0] + PAPER[2] + 0.003, PAPER[1], 0.008, PAPER[3])) if placed else None
        bar = fig.colorbar(image, ax=ax, cax=beside)
        bar.ax.tick_params(labelsize=7)


def _cell_texts(ax, z, template, text=None) -> None:
    """Each cell's label as the trace's texttemplate writes it ("%{z:.0%}", or "%{text}": a frontier cell's peak /
    capacity, its colour being peak / its line), so a PNG says what the live heatmap says in each cell. Why dark
    text: every colour of the scale is a light or mid one."""
    if template == "%{text}" and text is not None:
        labels = [[str(t) for t in row] for row in text]
    else:
        match = re.fullmatch(r"%\{z(?::([^}]*))?\}", template or "")
        if match is None:
            return
        labels = [[format(v, match.group(1) or "") if v == v else "" for v in row] for row in z]
    for row, values in enumerate(z):
        for column, value in enumerate(values):
            if value == value and labels[row][column]:  # why: NaN (a gap, a refused cell) has no text
                ax.text(column, row, labels[row][column], ha="center", va="center", fontsize=6)


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


def _whole(ref) -> bool:
    """Whether a shape's or note's reference spans the plot (plotly's paper, or an axis' domain) rather than data."""
    return ref == "paper" or str(ref).endswith("domain")


def _shape(ax, shape, key: dict) -> None:
    """A phase band (named: a key entry), a limit line (on top: nothing hides it), a step separator or a frame."""
    from matplotlib.patches import Rectangle

    kind, xref, yref = shape.get("type"), shape.get("xref") or "x", shape.get("yref") or "y"
    colour = _colour(shape.get("fillcolor") or _get(shape, "line", "color"), "#888888")
    if kind == "rect" and _whole(yref):  # a band: its x range, the plot's full height
        alpha = shape.get("opacity") or 0.15
        ax.axvspan(shape["x0"], shape["x1"], color=colour, alpha=alpha, linewidth=0, zorder=0)
        if shape.get("name"):
            key.setdefault(shape["name"], (colour, alpha))
    elif kind == "line" and _whole(xref):  # a limit: across the plot at its y
        ax.axhline(shape["y0"], color=colour, linestyle="--", linewidth=1.2, zorder=4)
    elif kind == "line" and _whole(yref):  # a step separator
        ax.axvline(shape["x0"], color=colour, linewidth=0.8, linestyle=":", zorder=3)
    elif kind == "rect":  # a frame in data coordinates (the frontier's current cell)
        width, height = shape["x1"] - shape["x0"], shape["y1"] - shape["y0"]
        edge = _colour(_get(shape, "line", "color"), INK)
        ax.add_patch(Rectangle((shape["x0"], shape["y0"]), width, height, fill=False, edgecolor=edge, linewidth=2))


def _note(ax, note) -> None:
    """An annotation where plotly puts it (data or the plot's fraction on each axis), rotated and anchored as there."""
    from matplotlib.transforms import blended_transform_factory

    xref, yref = note.get("xref") or "x", note.get("yref") or "y"
    transform = blended_transform_factory(
        ax.transAxes if _whole(xref) else ax.transData, ax.transAxes if _whole(yref) else ax.transData
    )
    ha, va = ANCHORS.get(note.get("xanchor"), "center"), ANCHORS.get(note.get("yanchor"), "center")
    nudge = ({"left": 2, "right": -2}.get(ha, 0), {"bottom": 1, "top": -1}.get(va, 0))  # off the spine or line
    ax.annotate(
        _text(note.get("text")),
        (note.get("x", 0.5), note.get("y", 0.5)),
        xycoords=transform,
        xytext=nudge,
        textcoords="offset points",
        rotation=-(note.get("textangle") or 0),
        ha=ha,
        va=va,
        fontsize=0.8 * (_get(note, "font", "size") or 10),
        color=INK,
        annotation_clip=False,
    )


def _panel_of(note) -> str:
    """The panel (its x axis' name) a note is on: its x axis, else its y axis' twin ("y2": "x2"), else the first."""
    xref, yref = note.get("xref") or "x", note.get("yref") or "y"
    if xref != "paper":
        return xref.split()[0]
    return "x" + yref.split()[0][1:] if yref != "paper" else "x"


def _notes(ax, layout: dict, panel: str, placed: bool) -> None:
    """The panel's annotations (the page's own, subplot titles, are the canvas'). The phase key's coloured squares
    are HTML: the key is drawn from the named bands instead (_legend)."""
    for note in layout.get("annotations") or []:
        on_page = note.get("xref") == "paper" and note.get("yref") == "paper"
        if note.get("name") != "phase-key" and not (placed and on_page) and _panel_of(note) == panel:
            _note(ax, note)


def _panel(ax, traces, canvas, placed: bool) -> None:
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
            _heatmap(ax, trace, canvas, placed)


def _legend(ax, canvas, key: dict, placed: bool, named: bool) -> None:
    """The lines' names and the bands' key: under the plot for one panel (it hides no data), in the panel otherwise."""
    from matplotlib.patches import Patch

    handles, labels = ax.get_legend_handles_labels() if named else ([], [])
    for name, (colour, alpha) in key.items():
        handles.append(Patch(facecolor=colour, alpha=min(1.0, 2 * alpha), label=name))
        labels.append(name)
    if not handles:
        return
    style = dict(fontsize=8, labelcolor=INK, frameon=False)
    if placed:
        ax.legend(handles, labels, loc="best", **style)
        return
    # why measured: a rank's long merged names made five columns wider than the PNG, cut at both ends
    renderer = canvas.canvas.get_renderer()
    for ncols in range(min(len(handles), 5), 0, -1):
        legend = canvas.legend(handles, labels, loc="outside lower center", ncols=ncols, **style)
        if ncols == 1 or legend.get_window_extent(renderer).width <= canvas.bbox.width:
            return
        legend.remove()


def _ink(canvas) -> None:
    """Every axis (colour bars too) in INK on a transparent background, the grid faint."""
    for ax in canvas.axes:
        ax.tick_params(colors=INK, which="both")
        for spine in ax.spines.values():
            spine.set_color(INK)
        ax.xaxis.label.set_color(INK)
        ax.yaxis.label.set_color(INK)


def draw(fig, width: int = WIDTH, height: int = None):
    """`fig` (a plotly Figure or its dict) as a matplotlib Figure, `width` x its own height (or 420) pixels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # why the class, not pyplot: no global figure state in the user's kernel

    data = fig.to_dict() if hasattr(fig, "to_dict") else fig
    layout = data.get("layout", {})
    height = height or layout.get("height") or 420
    traces = data.get("data", [])
    panels = list(dict.fromkeys(t.get("xaxis") or "x" for t in traces)) or ["x"]  # subplots side by side
    placed = len(panels) > 1 and _get(layout, "xaxis", "domain") is not None
    canvas = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout=None if placed else "constrained")
    FigureCanvasAgg(canvas)  # why: a renderer to measure the legend with (savefig draws with Agg anyway)
    for column, panel in enumerate(panels):
        ax = _axes(canvas, layout, panel, column, len(panels)) if placed else canvas.add_subplot(1, 1, 1)
        mine = [t for t in traces if (t.get("xaxis") or "x") == panel]
        _panel(ax, mine, canvas, placed)
        suffix, key = panel[1:], {}
        for shape in layout.get("shapes") or []:
            xref = shape.get("xref") or "x"
            if xref == "paper" or xref.split()[0] == panel:
                _shape(ax, shape, key)
        _notes(ax, layout, panel, placed)
        y_range = _get(layout, f"yaxis{suffix}", "range")
        if y_range:
            ax.set_ylim(*y_range)
        size = 8 if placed else 10  # why smaller beside other panels: a long field name ran into the next panel
        ax.set_xlabel(_text(_get(layout, f"xaxis{suffix}", "title")), fontsize=size)
        ax.set_ylabel(_text(_get(layout, f"yaxis{suffix}", "title")), fontsize=size)
        named = any(t.get("name") and t.get("showlegend", True) for t in mine if t.get("type") != "heatmap")
        _legend(ax, canvas, key, placed, named)
        ax.grid(color=GRID)
    for note in layout.get("annotations") or []:  # subplot titles and other notes placed on the page
        if note.get("xref") == "paper" and note.get("yref") == "paper" and placed:
            x, y = _on_canvas(note["x"], note["y"])
            canvas.text(x, y + 0.01, _text(note.get("text")), fontsize=8, ha="center", color=INK)
    canvas.suptitle(_title(layout.get("title")), fontsize=9, color=INK)
    _ink(canvas)
    return canvas


def png(fig, width: int = WIDTH, height: int = None) -> bytes:
    """`fig` (a plotly Figure or its dict) as PNG bytes, `width` x its own height (or 420) pixels, on a transparent
    background (the module's docstring says why)."""
    out = io.BytesIO()
    draw(fig, width, height).savefig(out, format="png", transparent=True)
    return out.getvalue()


def neutral(data: dict) -> dict:
    """The figure's dict with the PNG's look: transparent paper and plot, INK text, a faint grid. Why: plotly's
    renderer in JupyterLab draws the live figure in place of the PNG when the pointer enters it, and plotly's own
    template is white."""
    layout = data.setdefault("layout", {})
    layout.update(paper_bgcolor=CLEAR, plot_bgcolor=CLEAR)
    layout.setdefault("font", {})["color"] = INK
    axes = _get(layout, "template", "layout", default={})
    grid = "rgba(128,128,128,0.25)"
    for name in ("xaxis", "yaxis"):
        axes.setdefault(name, {}).update(gridcolor=grid, zerolinecolor=grid, linecolor=grid)
    return data


def show(fig, width: int = WIDTH) -> None:
    """Display a plotly figure in one form: live (plotly's JSON) where a person's frontend draws it, a PNG where no
    one is there (papermill, nbconvert: runtime.frontend_is_live), so a saved run, a sweep's output or GitHub shows
    it. Why not both: a saved notebook then held every figure twice."""
    from IPython.display import display

    from ..runtime import frontend_is_live

    data = neutral(fig.to_dict())
    title = _title(_get(data, "layout", "title")) or "figure"
    form = {"application/vnd.plotly.v1+json": data} if frontend_is_live() else {"image/png": png(data, width)}
    display({**form, "text/plain": title}, raw=True)
