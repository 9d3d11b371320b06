"""The fit frontier: the memory plan over a grid of completion length x num_generations x micro-batch, before anything
runs. Each cell is `plan()` of the config with those three overrides (nothing is loaded); the grid is a text table, a
plotly heatmap per micro-batch and a self-contained HTML page. TRL has no such view: its trainer finds out by OOM."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from ..errors import LabError
from ..models.shapes import ModelShape, load_shape
from .grid import FIELDS, Point, grid, micro_label, micro_order
from .render import size

# colour = the binding device's peak over its line (host RAM: memory.host_threshold of its capacity, where the guard
# stops a phase; a GPU: all of it) on one scale broken at 90% and 100% of that line, as the plan's verdict is: green
# fits, fading to yellow near the edge; amber tight; red does not fit (a host peak between the line and the capacity
# is red: the guard would stop it). A discrete fits/tight/no scale would hide that 85% and 20% are not the same "fits"
ZMAX = 2.0  # the colour saturates at twice the line; the cell label (of capacity) and hover give the real fraction
COLOURS = [[0.0, "#1a9850"], [0.45, "#d9ef8b"], [0.45, "#fdb863"], [0.5, "#f08a24"], [0.5, "#d73027"], [1.0, "#67001f"]]
REFUSED_GREY = "#d9d9d9"


@dataclass(frozen=True)
class Cell:
    length: int  # generator.max_completion_length
    generations: int  # grpo.num_generations
    micro_batch: Optional[int]  # grpo.micro_batch_size (None: the whole batch in one pass)
    fits: bool = False  # plan.fits: every device fits
    device: str = ""  # the binding device: the nearest its line (the highest fraction of what it may hold)
    peak: float = 0.0  # its planned peak, bytes
    phase: Optional[str] = None  # the phase of that peak (DevicePlan.peak_phase; None: resident only)
    headroom: float = 0.0  # its line - peak, bytes (host: the guard's line; negative: it does not fit)
    fraction: float = 0.0  # peak / capacity
    line: float = 1.0  # the binding device's line, a share of its capacity (DevicePlan.line)
    refused: Optional[str] = None  # the config's one-line refusal of this combination; the rest is then empty
    measured: Optional[str] = None  # a measured run of this point (planner/measured.py): "ran, peak ..." or its failure

    @property
    def of_line(self) -> float:
        """peak / the binding device's line: the figure's colour (1.0 is where the verdict turns to "does not fit")."""
        return self.fraction / self.line

    @property
    def point(self) -> Point:
        return self.length, self.generations, self.micro_batch

    def short(self) -> str:
        """The table's cell: "ok 63%", "NO 140%", or "-" for a combination the config refuses; a measured point adds
        "+" (it ran) or "!" (it failed)."""
        mark = "" if self.measured is None else (" +" if self.measured.startswith("ran") else " !")
        return "-" if self.refused else f"{'ok' if self.fits else 'NO'} {self.fraction:.0%}{mark}"

    def hover(self) -> str:
        where = (
            f"completion length {self.length}, num_generations {self.generations}, "
            f"micro-batch {micro_label(self.micro_batch)}"
        )
        if self.refused:
            return f"{where}<br><b>refused</b>: {html.escape(self.refused)}"
        verdict = "fits" if self.fits else "does not fit"
        during = f" during {self.phase}" if self.phase else " (resident)"
        return (
            f"{where}<br><b>{verdict}</b> ({self.fraction:.0%} of {self.device})<br>binding device: {self.device}"
            f"<br>peak: {size(self.peak)}{during}<br>headroom: {size(self.headroom)}"
            + (f"<br><b>measured</b>: {html.escape(self.measured)}" if self.measured else "")
        )


@dataclass
class Frontier:
    config: object  # the LabConfig the grid varies
    cells: list[Cell]  # one per (length, generations, micro-batch), in that sort order
    current: Point  # the config's own point (always in the grid)
    capacities: dict[str, float]  # the devices of the config's own plan and their capacities, bytes
    turns: Optional[int] = None  # a tool loop's turns (generator.max_tool_calling_iterations + 1): planner/turn_axis.py

    @property
    def lengths(self) -> list[int]:
        return sorted({c.length for c in self.cells})

    @property
    def generations(self) -> list[int]:
        return sorted({c.generations for c in self.cells})

    @property
    def micro_batches(self) -> list[Optional[int]]:
        return sorted({c.micro_batch for c in self.cells}, key=micro_order)

    def cell(self, length: int, generations: int, micro_batch: Optional[int]) -> Cell:
        for c in self.cells:
            if c.point == (length, generations, micro_batch):
                return c
        raise KeyError(f"({length}, {generations}, {micro_batch}) is not in this frontier's grid")

    def title(self) -> str:
        devices = ", ".join(f"{d} {size(c).strip()}" for d, c in self.capacities.items())
        turns = "" if self.turns is None else f", {self.turns} turns (a tool loop)"
        return f"Fit frontier: {self.config.model.name_or_path} on {devices}{turns}"

    def __str__(self) -> str:
        return render_table(self)

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))

    def figure(self):
        """A heatmap per micro-batch (subplots side by side, not a dropdown: the point is comparing them at a glance,
        and a page or screenshot shows every one): completion length (x) by num_generations (y)."""
        return build_figure(self)

    def to_html(self, path: Union[str, Path], what: str = "path") -> Path:
        """Write a self-contained page (plotly.js inlined: no CDN, machines may be offline) atomically; returns its
        absolute path. `what` names the argument in errors (the CLI: --out)."""
        from ..checks.paths import check_output_dir
        from ..files import atomic_write_text

        path = Path(path).absolute()
        if path.is_dir():
            raise LabError(
                f"{what}: {str(path)!r} is a directory; give the path of the HTML file to write, "
                f"e.g. {path / 'frontier.html'}"
            )
        check_output_dir(path.parent, what)
        return atomic_write_text(path, page(self))

    def _ipython_display_(self):
        from IPython import get_ipython

        if getattr(get_ipython(), "kernel", None) is None:  # a terminal IPython: the table (plotly opens a browser)
            print(self)
            return
        from ..memory.static import show

        show(self.figure())  # live where plotly renders, and a PNG that a saved notebook keeps


def evaluate(config, point: Point, shape: ModelShape) -> Cell:
    """One cell: plan() of `config` at `point`, or the config's refusal of it."""
    from ..config.loading import load_config
    from .plan import plan

    overrides = [f"{f}={'null' if v is None else v}" for f, v in zip(FIELDS, point)]
    try:  # why catch: a combination the config refuses is a grey cell with its reason, not the end of the frontier
        result = plan(load_config(config, overrides), shape)
    except LabError as err:
        return Cell(*point, refused=str(err).splitlines()[0])
    binding = max(result.devices.values(), key=lambda d: d.fraction / d.line)  # (host RAM: the guard's line)
    return Cell(
        *point,
        fits=result.fits,
        device=binding.device,
        peak=binding.total,
        phase=binding.peak_phase,
        headroom=binding.line_bytes - binding.total,
        fraction=binding.fraction,
        line=binding.line,
    )


def frontier(
    config, lengths=None, generations=None, micro_batches=None, shape: Optional[ModelShape] = None
) -> Frontier:
    """The plan of `config` (a LabConfig, preset name, YAML path or dict) over completion lengths x num_generations x
    micro-batch sizes. Each range is a list of positive ints or a range string ("64,128" or "64:1024"); the config's
    own values are always added, so its point is marked. A combination the config refuses is a cell with `refused`."""
    from ..config.loading import load_config
    from .plan import plan

    config = load_config(config)
    axes = grid(config, lengths, generations, micro_batches)
    shape = shape or load_shape(config.model.name_or_path)
    # why plan the config itself first: what is wrong for every cell (a GPU not here without placement.gpu_memory_gib)
    # is one error, not a grid of grey cells
    own = plan(config, shape)
    cells = [
        evaluate(config, (length, gens, micro), shape) for micro in axes[2] for gens in axes[1] for length in axes[0]
    ]
    current = (config.generator.max_completion_length, config.grpo.num_generations, config.grpo.micro_batch_size)
    return Frontier(config, cells, current, {name: d.capacity for name, d in own.devices.items()})


def render_table(front: Frontier) -> str:
    """Rows num_generations, columns completion length, one block per micro-batch; * marks the current point."""
    length, gens, micro = front.current
    lines = [
        front.title(),
        "cell: the binding device's planned peak / capacity (ok: fits, NO: does not fit, "
        "-: the config refuses it); * the config's own point",
        "",
    ]
    width = max(9, *(len(c.short()) + 2 for c in front.cells))
    refusals: dict[str, list[str]] = {}
    for m in front.micro_batches:
        lines.append(f"grpo.micro_batch_size {micro_label(m)}{' *' if m == micro else ''}")
        header = "".join(f"{str(n) + ('*' if n == length else ''):>{width}}" for n in front.lengths)
        lines.append(f"{'G':>6}  {header}    <- generator.max_completion_length")
        for g in front.generations:
            row = [front.cell(n, g, m) for n in front.lengths]
            lines.append(f"{str(g) + ('*' if g == gens else ''):>6}  " + "".join(f"{c.short():>{width}}" for c in row))
            for c in row:
                if c.refused:
                    refusals.setdefault(c.refused, []).append(
                        f"length {c.length}, G {c.generations}, micro-batch {micro_label(m)}"
                    )
        lines.append("")
    now = front.cell(*front.current)
    lines.append(
        f"current: length {length}, G {gens}, micro-batch {micro_label(micro)}: "
        + (
            f"refused: {now.refused}"
            if now.refused
            else f"{'fits' if now.fits else 'does not fit'}, {now.device} {now.fraction:.0%} "
            f"(peak {size(now.peak)}{f' during {now.phase}' if now.phase else ''}, headroom {size(now.headroom)})"
        )
    )
    if any(c.measured for c in front.cells):
        from .measured import edges

        lines += ["measured (--measured): + ran, ! failed", *edges(front)]
    for reason, points in refusals.items():  # one line per reason: a refused axis value refuses a whole row
        lines.append(f"refused ({len(points)} cell{'s' * (len(points) > 1)}, e.g. {points[0]}): {reason}")
    return "\n".join(lines)


def _micro_traces(front: Frontier, micro: Optional[int], colour_bar: bool) -> list:
    """The grey refused cells under the coloured ones (null z is a transparent gap), one grid each."""
    import plotly.graph_objects as go

    x, y = [str(n) for n in front.lengths], [str(g) for g in front.generations]
    rows = [[front.cell(n, g, micro) for n in front.lengths] for g in front.generations]
    hover = [[c.hover() for c in row] for row in rows]
    refused = go.Heatmap(
        x=x,
        y=y,
        z=[[0 if c.refused else None for c in row] for row in rows],
        name="refused",
        colorscale=[[0, REFUSED_GREY], [1, REFUSED_GREY]],
        showscale=False,
        hoverongaps=False,
        text=hover,
        hovertemplate="%{text}<extra></extra>",
        xgap=2,
        ygap=2,
    )
    colour = go.Heatmap(
        x=x,
        y=y,
        z=[[None if c.refused else c.of_line for c in row] for row in rows],
        name=f"micro-batch {micro_label(micro)}",
        zmin=0,
        zmax=ZMAX,
        colorscale=COLOURS,
        hoverongaps=False,
        text=[["" if c.refused else f"{c.fraction:.0%}" for c in row] for row in rows],  # the label: of capacity
        customdata=hover,
        hovertemplate="%{customdata}<extra></extra>",
        texttemplate="%{text}",
        xgap=2,
        ygap=2,
        showscale=colour_bar,
        colorbar=dict(
            title="peak / its line",
            tickvals=[0, 0.5, 0.9, 1.0, 1.5, 2.0],
            ticktext=["0%", "50%", "90% tight", "100% line", "150%", ">= 200%"],
        ),
    )
    return [refused, colour]


def build_figure(front: Frontier):
    from plotly.subplots import make_subplots

    micros = front.micro_batches
    cols = min(len(micros), 3)
    nrows = -(-len(micros) // cols)
    titles = [f"grpo.micro_batch_size: {micro_label(m)}" for m in micros]
    fig = make_subplots(
        rows=nrows,
        cols=cols,
        subplot_titles=titles,
        horizontal_spacing=0.06,
        vertical_spacing=0.12 if nrows > 1 else 0.0,
    )
    for i, micro in enumerate(micros):
        row, col = i // cols + 1, i % cols + 1
        for trace in _micro_traces(front, micro, colour_bar=i == 0):  # one colour bar: every grid shares the scale
            fig.add_trace(trace, row=row, col=col)
        fig.update_xaxes(type="category", title_text="generator.max_completion_length", row=row, col=col)
        fig.update_yaxes(type="category", title_text="grpo.num_generations" if col == 1 else None, row=row, col=col)
        if micro == front.current[2]:
            _mark_current(fig, front, i + 1)
    fig.update_layout(
        title=dict(
            text=f"{html.escape(front.title())}<br><sup>colour: the binding device's planned peak / its line "
            "(host RAM: memory.host_threshold of it; green fits, amber tight: under 10% margin, red does not fit; "
            "grey: the config refuses it); label: peak / capacity; hover a cell for its device, peak, phase and "
            "headroom</sup>"
        ),
        height=360 * nrows + 140,
        template="plotly_white",
        margin=dict(t=110),
    )
    return fig


def _mark_current(fig, front: Frontier, subplot: int) -> None:
    """A frame around the config's own cell and the word "current" in it (annotation, named for readers)."""
    suffix = "" if subplot == 1 else str(subplot)
    # why indices, not the category names: plotly.js reads a number-like name ("768") in a shape or annotation as a
    # coordinate, and stretches the axis to it
    x, y = front.lengths.index(front.current[0]), front.generations.index(front.current[1])
    fig.add_shape(
        type="rect",
        x0=x - 0.5,
        x1=x + 0.5,
        y0=y - 0.5,
        y1=y + 0.5,
        xref=f"x{suffix}",
        yref=f"y{suffix}",
        line=dict(color="black", width=3),
        name="current",
    )
    fig.add_annotation(
        x=x,
        y=y,
        xref=f"x{suffix}",
        yref=f"y{suffix}",
        text="<b>current</b>",
        showarrow=False,
        bgcolor="rgba(255, 255, 255, 0.85)",
        yshift=14,
        name="current",
    )  # readable on dark red too


def page(front: Frontier) -> str:
    body = front.figure().to_html(include_plotlyjs=True, full_html=False)  # why inline: no CDN on offline machines
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>grpo_lab fit frontier</title></head>"
        f"<body style='font-family:sans-serif'>{body}<pre id='frontier-table'>{html.escape(str(front))}</pre>"
        "</body></html>"
    )


__all__ = ["Cell", "Frontier", "frontier"]
