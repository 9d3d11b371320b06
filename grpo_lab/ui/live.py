"""The live memory plot for notebooks: a plotly FigureWidget with the host's lines and each GPU's ledger
stacked (torch allocated, torch cache, not torch: figures.LEDGER), shaded phase bands, and dashed lines
for each device's capacity and the host-RAM threshold.

The running phase's band grows as it runs (its x is working time, not squeezed idle). The view shows the last
`max_steps` steps (the title says so once there are more), every step's bands kept; phases are named in one row of
coloured squares, the lines' legend is one row below, and a step label too close to the last one is left out.
A plot replaced by a newer one (another `lab.memory_plot()` or `lab.ui()`) says so in its title and stops.
In a headless run (papermill, nbconvert) no widget is made at all (`runtime.frontend_is_live`): a line says so
instead.

A renderer thread redraws it from the sampler's buffer every `refresh_s` seconds (throttled); the
sampler thread never touches the widget, and the kernel stays free to run cells while a step
runs; it stops with Lab.close() or when the widget is closed. Its history is bounded (`Series`): each line
keeps at most 2 x `max_points` points over the whole run, halving its resolution when full by
merging neighbours into their maximum (so a peak is never lost); refreshes from the renderer and
from a cell are serialised by a lock.
"""

from __future__ import annotations

import html
import threading
import time
from typing import Optional

from ..memory.figures import (
    BAND_OPACITY,
    FAR,
    band_labels,
    band_shapes,
    drawn,
    limit_line,
    limit_name,
    merge_twins,
    phase_key_annotation,
    stack_top,
    step_note,
    step_separators,
    trace_order,
    trace_style,
    turn_marks,
    work_clock,
)
from ..memory.readers import MiB
from ..memory.report import host_limits
from ..memory.tables import size_text


def _needs_notebook_extra():
    try:
        import anywidget  # noqa: F401
        import plotly.graph_objects as go
    except ImportError as err:
        from ..errors import LabError

        raise LabError(f"the live memory plot needs {err.name}; install grpo-lab[notebook]") from None
    return go


class NotLive:
    """What `lab.memory_plot()` and `lab.ui()` give in a headless run: one line saying what a person would see and
    what the saved notebook keeps instead; no widget, so nothing lands in the notebook's widget state."""

    def __init__(self, what: str):
        self.what = what

    def text(self) -> str:
        return (
            f"{self.what}: a widget drawn live when a person runs this notebook; this headless run (papermill, "
            "nbconvert) made none. lab.memory_snapshot() keeps the memory plot as an image."
        )

    def __repr__(self) -> str:
        return f"<{self.text()}>"

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/plain": self.text(), "text/html": f"<i>{html.escape(self.text())}</i>"}


class Series:
    """One line's bounded history: each point is the maximum of `stride` readings (at the last one's time).
    When it holds more than `limit` points, neighbours merge and the stride doubles, so the whole run
    stays in view at one resolution and a peak is never lost."""

    def __init__(self, limit: int):
        self.limit, self.stride = limit, 1
        self.xs: list[float] = []
        self.ys: list[float] = []
        self._count, self._peak = 0, float("-inf")  # readings of the point being filled

    def add(self, t: float, value: float) -> None:
        self._count, self._peak = self._count + 1, max(self._peak, value)
        if self._count < self.stride:
            return
        self.xs.append(t)
        self.ys.append(self._peak)
        self._count, self._peak = 0, float("-inf")
        if len(self.xs) > self.limit:
            odd = len(self.xs) % 2
            self.xs = self.xs[1::2] + (self.xs[-1:] if odd else [])
            self.ys = [max(a, b) for a, b in zip(self.ys[0::2], self.ys[1::2])] + (self.ys[-1:] if odd else [])
            self.stride *= 2


# why CSS: the kernel cannot know the theme (a user switches it at any time); under a dark JupyterLab theme the plot's
# white paper, its dark text and its grid take the theme's colours, as plotly's dark template would
PLOT_CSS = """<style>
body[data-jp-theme-light="false"] .grpo-lab-plot .main-svg { background: transparent !important; }
body[data-jp-theme-light="false"] .grpo-lab-plot rect.bg { fill: var(--jp-layout-color1) !important; }
body[data-jp-theme-light="false"] .grpo-lab-plot text { fill: var(--jp-ui-font-color1) !important; }
body[data-jp-theme-light="false"] .grpo-lab-plot .gridlayer path,
body[data-jp-theme-light="false"] .grpo-lab-plot .zerolinelayer path { stroke: var(--jp-border-color1) !important; }
</style>"""

# why: between phases only the squeezed idle tail changes; redrawing it every refresh_s (the sampler keeps sampling)
# had the kernel handle the browser's replies twice a second, and JupyterLab showed it Busy while nothing ran
IDLE_REFRESH_S = 2.0


class LivePlot:
    def __init__(self, sampler, refresh_s: float = 0.5, max_points: int = 600, max_steps: int = 10):
        go = _needs_notebook_extra()
        self.sampler, self.refresh_s, self.max_points, self.max_steps = sampler, refresh_s, max_points, max_steps
        self._series: dict[tuple[str, str], Series] = {}
        self._index = 0  # next sampler sample to ingest
        self._marks_drawn = -1  # phase bands are redrawn only when a phase has ended
        self._turns_drawn = 0  # ... or a turn of a tool loop's rollout has begun
        self._limits = host_limits(sampler)
        self._near: dict[str, float] = {}
        self._clock = lambda t: t  # sample time -> x (figures.work_clock: idle squeezed)
        self._title = "Live memory (MiB)"  # what the title says besides the window and the off-scale limits
        self._running_band: Optional[int] = None  # the index in layout.shapes of the running phase's band
        self.fig = go.FigureWidget(
            layout=dict(
                title=dict(text=self._title, x=0.01, xanchor="left", y=0.98, yanchor="top", font=dict(size=14)),
                xaxis_title=dict(text="seconds of work (idle spans squeezed to 1 s)", font=dict(size=11)),
                yaxis_title="MiB",
                height=380,  # why: with the panel's buttons and log, one 679 px view (1280 x 800, file browser open)
                autosize=True,
                # why these margins: the plot area keeps over 70 % of the height; the title, the lines' legend (left)
                # and the phase key (right) share the top margin, the x axis' title the bottom one; the right one holds
                # plotly's toolbar, upright (across the top it covered a long title: a replaced plot's)
                margin=dict(t=62, l=50, r=40, b=42),
                modebar=dict(orientation="v"),
                legend=dict(orientation="h", x=0, xanchor="left", y=1.0, yanchor="bottom", font=dict(size=10)),
                annotations=[phase_key_annotation()],
            )
        )
        self.fig.layout.width = None  # full width of the cell
        self.fig.add_class("grpo-lab-plot")  # PLOT_CSS: the plot follows JupyterLab's theme
        self._lines: dict[tuple[str, str], int] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()  # why: the renderer thread and a cell (display, Panel) both refresh
        self.refreshes = 0
        self._drawn_at = float("-inf")  # monotonic time of the last redraw
        # a closed widget is never drawn again, so its renderer stops: closed in the kernel (fig.close() sets
        # the widget's comm to None) or by the frontend (a comm_close message, which only the comm hears)
        self.fig.observe(lambda change: self.stop() if change["new"] is None else None, names="comm")
        if self.fig.comm is not None:
            self.fig.comm.on_close(lambda msg: self.stop())

    def _ingest(self) -> Optional[dict[tuple[str, str], tuple[list, list]]]:
        """Add only the samples taken since the last refresh to the bounded lines; return each line's points, or
        None when nothing arrived and no phase ended (nothing to redraw)."""
        new = self.sampler.samples_since(self._index)
        self._index += len(new)
        if not new and len(self.sampler.marks) == self._marks_drawn and self._lines:
            return None
        for t, _, _, device, metric, value in new:
            if drawn(device, metric):
                self._series.setdefault((device, metric), Series(2 * self.max_points)).add(t, value / MiB)
        ordered = sorted(self._series, key=lambda key: trace_order(*key))  # why: a stack is drawn in trace order
        now = max((line.xs[-1] for line in self._series.values() if line.xs), default=0.0)
        running = self._running(now)
        # why the running phase too: else its time counts as idle and is squeezed until it ends (the axis jumped)
        self._clock = work_clock(self.sampler.marks + running, now)
        return {key: ([self._clock(t) for t in self._series[key].xs], list(self._series[key].ys)) for key in ordered}

    def _draw_lines(self, series) -> None:
        """Each line's points; a host's `used` that is its `rss` point for point is hidden and the rss line says so
        (figures.merge_twins: under placement.host_memory_gib both are the Lab's RSS, and one hid the other)."""
        names = merge_twins(series)
        for key, (xs, ys) in series.items():
            style = trace_style(*key)
            style["name"] = names.get(key, style["name"])
            if key not in self._lines:
                self.fig.add_scatter(x=xs, y=ys, **style)
                self._lines[key] = len(self.fig.data) - 1
                continue
            trace = self.fig.data[self._lines[key]]
            trace.x, trace.y = xs, ys
            if (trace.name, trace.visible) != (style["name"], True):
                trace.name, trace.visible = style["name"], True
        for key, index in self._lines.items():
            if key not in series and self.fig.data[index].visible is not False:
                self.fig.data[index].visible = False  # a twin merged into its rss line

    def _running(self, now: float) -> list[tuple]:
        """The phase under way as a mark that ends now (none between phases)."""
        running = self.sampler.running() if hasattr(self.sampler, "running") else None
        return [] if running is None else [(*running, max(now, running[2]))]

    def _window(self, marks) -> tuple[list, str]:
        """The marks of the last `max_steps` steps, and what the title says about the window (nothing before it
        leaves anything out)."""
        steps = sorted({step for step, *_ in marks})
        if len(steps) <= self.max_steps:
            return marks, ""
        kept = set(steps[-self.max_steps :])
        return [m for m in marks if m[0] in kept], f"  ·  last {self.max_steps} of {len(steps)} steps"

    def _limits_in_view(self, series, window: str = "", marks=()) -> dict[str, float]:
        """Limit lines near the data (figures.FAR) are drawn; farther ones are named in the title (and whether every
        step is labelled)."""
        top = stack_top(series) if series else 0.0
        near = {name: mib for name, mib in self._limits.items() if mib <= FAR * top}
        far = [f"{name}: {size_text(mib * MiB)}" for name, mib in self._limits.items() if name not in near]
        steps = step_note(marks)
        self.fig.layout.title.text = self._title + window + steps + (f"  ·  off scale: {', '.join(far)}" if far else "")
        return near

    def _shapes(self, marks, running) -> list[dict]:
        """The finished phases' bands, the running phase's band (its index kept: it grows), step separators and
        the drawn limits."""
        bands = band_shapes(marks + running, opacity=BAND_OPACITY)
        self._running_band = len(marks) if running else None
        lines = [limit_line(mib, name) for name, mib in self._near.items()]
        return bands + step_separators(marks) + lines + self._turns()[0]

    def _turns(self) -> tuple[list, list]:
        """The marks inside the phases drawn (a tool loop's turns: memory/figures.py turn_marks)."""
        return turn_marks(list(getattr(self.sampler, "segments", [])), self._clock)

    def _annotations(self, marks) -> list[dict]:
        """The drawn limit lines' names, then the phase and step labels."""
        names = [limit_name(name, mib) for name, mib in self._near.items()]
        return [phase_key_annotation()] + names + band_labels(marks) + self._turns()[1]

    def refresh(self) -> None:
        """Redraw from the sampler's buffer (called by the renderer thread, or by hand)."""
        with self._lock:
            self._refresh()

    def _refresh(self) -> None:
        # why read at every refresh: memory.host_threshold is live, and a line computed once disagreed with the guard
        # after an edit; a changed limit redraws at once, idle or not
        limits = host_limits(self.sampler)
        if limits != self._limits:
            self._limits, self._marks_drawn = limits, -1
        idle = getattr(self.sampler, "phase", None) == "idle" and len(self.sampler.marks) == self._marks_drawn
        if idle and self._lines and time.monotonic() - self._drawn_at < IDLE_REFRESH_S:
            return
        series = self._ingest()
        if series is None:  # why: a redraw sends the whole figure to the browser; the kernel would show Busy for it
            return
        with self.fig.batch_update():
            self._draw_lines(series)
            now = max((xs[-1] for xs, _ in series.values() if xs), default=0.0)
            running = [(s, p, self._clock(a), now) for s, p, a, _ in self._running(self._series_end())]
            marks, window = self._window([(s, p, self._clock(a), self._clock(b)) for s, p, a, b in self.sampler.marks])
            near = self._limits_in_view(series, window, marks + running)
            turned = len(getattr(self.sampler, "segments", [])) != self._turns_drawn  # (a turn began: drawn now)
            self._turns_drawn = len(getattr(self.sampler, "segments", []))
            grown = running and self._running_band is not None and len(self.sampler.marks) == self._marks_drawn
            grown = grown and not turned
            if grown and near.keys() == self._near.keys():
                # why one property: validating every shape is the costly part of a redraw; only this band moved
                self.fig.layout.shapes[self._running_band].x1 = now
            elif len(self.sampler.marks) != self._marks_drawn or near.keys() != self._near.keys() or running:
                self._marks_drawn, self._near = len(self.sampler.marks), near
                self.fig.layout.shapes = self._shapes(marks, running)
                self.fig.layout.annotations = self._annotations(marks + running)
            first = min((a for _, _, a, _ in marks + running), default=None)
            last = max([now] + [b for *_, b in marks + running])
            self.fig.layout.xaxis.range = [first, last] if window and first is not None else None
        self.refreshes += 1
        self._drawn_at = time.monotonic()

    def start(self) -> "LivePlot":
        if self._thread is None and self.fig.comm is not None:  # a closed widget has nowhere to draw
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="grpo-lab-plot", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.refresh()
            except Exception:  # a closed comm (kernel restarted, cell cleared) must not kill the thread loudly
                pass

    def _series_end(self) -> float:
        return max((line.xs[-1] for line in self._series.values() if line.xs), default=0.0)

    def retire(self, why: str) -> None:
        """Stop redrawing, and say so in the title (a newer plot replaced this one)."""
        self.stop()
        with self._lock:
            self._title = f"Live memory (MiB)  ·  stopped: {why}"
            self.fig.layout.title.text = self._title

    def stop(self) -> None:
        """Stop the renderer (Lab.close(), or the widget was closed); idempotent, safe from any thread."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2)

    def _ipython_display_(self):
        from IPython.display import HTML, display

        self.refresh()
        display(HTML(PLOT_CSS))
        display(self.mimebundle(), raw=True)

    def mimebundle(self) -> dict:
        """The widget's view, with a one-line text/plain (the FigureWidget's is its whole figure: 13-28 KB saved)."""
        return {**self.fig._repr_mimebundle_(), "text/plain": f"FigureWidget: {self._title}, drawn live"}
