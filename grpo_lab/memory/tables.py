"""Tables that read in a notebook and in a terminal: HTML that fits a JupyterLab output (848 px at 1280 px with the
file browser open: numbers right-aligned, a notes column that wraps in itself) and text that fits 120 columns (a long
cell wraps at word boundaries inside its own column, never mid-word). The plan, the per-phase memory table and a step
result are drawn with them."""

from __future__ import annotations

import html
import textwrap
from dataclasses import dataclass, field

from .readers import MiB

TEXT_WIDTH = 120  # a terminal's, and a saved notebook's plain-text fallback
MIN_WRAPPED = 24  # the narrowest a wrapping column gets before the line is let run past TEXT_WIDTH
GAP = "  "  # between two text columns
# why these: the output area is 848 px; a table as wide as its content, never wider than the output, its cells a
# little smaller than the notebook's text so a 7-column table fits; colours are JupyterLab's theme variables
TABLE_STYLE = "border-collapse:collapse;max-width:100%;font-size:12px;line-height:1.35;margin:2px 0 8px 0"
CELL_STYLE = "padding:1px 8px;border-bottom:1px solid var(--jp-border-color2, #ddd);vertical-align:top"
HEAD_STYLE = CELL_STYLE + ";font-weight:600;border-bottom:1px solid var(--jp-border-color1, #999)"
HEAD_WRAP = ";white-space:normal"  # a header may wrap at its spaces ("tool calls/row"): a wide step table still fits
NUMBER_STYLE = ";text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums"
TEXT_STYLE = ";text-align:left;white-space:nowrap"
WRAP_STYLE = ";text-align:left;white-space:normal;min-width:14em;color:var(--jp-ui-font-color2, #555)"


def size_text(nbytes: float) -> str:
    """The one way a size is written in the plan, the live plot and the snapshot (a limit reads the same in all three):
    GiB with 2 decimals from 1 GiB up, else MiB with 1."""
    return f"{nbytes / 2**30:.2f} GiB" if abs(nbytes) >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


@dataclass
class Column:
    name: str
    numeric: bool = False  # right-aligned
    wraps: bool = False  # a notes column: wraps at words in itself (at most one per table)
    min_width: int = 0  # text columns: at least this many characters (blocks of one plan line up)


@dataclass
class Table:
    """Rows of already-formatted cells under `columns`; a cell's leading spaces indent it (a sub-item). `strong`: the
    indices of rows that sum up the ones above (a device's peak)."""

    columns: list[Column]
    rows: list[list[str]]
    title: str = ""
    strong: set = field(default_factory=set)
    indent: int = 0  # text: the rows' indent under the title

    def widths(self, width: int) -> list[int]:
        """Each column's text width: its widest cell, the wrapping column what is left of `width`."""
        out = [max([len(c.name), c.min_width, *(len(r[i]) for r in self.rows)]) for i, c in enumerate(self.columns)]
        for i, column in enumerate(self.columns):
            if column.wraps:
                rest = width - sum(w for j, w in enumerate(out) if j != i) - len(GAP) * (len(out) - 1)
                out[i] = min(out[i], max(rest, MIN_WRAPPED))
        return out

    def text(self, width: int = TEXT_WIDTH, header: bool = True) -> str:
        """The table no wider than `width` (but where one word is longer than its column), its title first; `header`:
        the columns' names under it."""
        widths = self.widths(width - self.indent)
        lines = [self.title] if self.title else []
        for cells in [[c.name for c in self.columns]] * header + self.rows:
            parts = [
                textwrap.wrap(cell, w, break_long_words=False, break_on_hyphens=False) or [""]
                if column.wraps
                else [cell]
                for column, cell, w in zip(self.columns, cells, widths)
            ]
            for k in range(max(map(len, parts))):
                line = GAP.join(
                    (part[k] if k < len(part) else "").rjust(w)
                    if column.numeric
                    else (part[k] if k < len(part) else "").ljust(w)
                    for column, part, w in zip(self.columns, parts, widths)
                )
                lines.append((" " * self.indent + line).rstrip())
        return "\n".join(lines)

    def html(self) -> str:
        def cell(tag: str, column: Column, text: str, style: str) -> str:
            indent = len(text) - len(text.lstrip(" "))
            pad = f";padding-left:{8 + 6 * indent}px" if indent else ""
            kind = NUMBER_STYLE if column.numeric else WRAP_STYLE if column.wraps else TEXT_STYLE
            wrap = HEAD_WRAP if tag == "th" else ""
            return f"<{tag} style='{style}{kind}{pad}{wrap}'>{html.escape(text.strip(), quote=False)}</{tag}>"

        head = "".join(cell("th", c, c.name, HEAD_STYLE) for c in self.columns)
        body = "".join(
            "<tr>"
            + "".join(
                cell("td", c, text, CELL_STYLE + (";font-weight:600" if i in self.strong else ""))
                for c, text in zip(self.columns, r)
            )
            + "</tr>"
            for i, r in enumerate(self.rows)
        )
        caption = (
            f"<caption style='text-align:left;font-weight:600;padding:2px 0'>{html.escape(self.title)}</caption>"
            if self.title
            else ""
        )
        table = f"<table class='grpo-lab-table' style='{TABLE_STYLE}'>"
        return f"{table}{caption}<thead><tr>{head}</tr></thead>{body}</table>"


def wrap_line(line: str, width: int = TEXT_WIDTH) -> str:
    """A line of prose at most `width` wide, wrapped at words; its continuation lines hang two spaces under it."""
    lead = " " * (len(line) - len(line.lstrip(" ")))
    return "\n".join(
        textwrap.wrap(
            line,
            width,
            initial_indent="",
            subsequent_indent=lead + "  ",
            break_long_words=False,
            break_on_hyphens=False,
            drop_whitespace=True,
        )
        or [""]
    )


def phase_table(rows: list[dict], title: str = "", marks: list[dict] = ()) -> Table:
    """The per-phase rows of a step (phase x device x metric: start, peak, end, delta) in MiB; each phase's marks
    (a tool loop's turns) after its rows, their peak alone."""
    from .readers import MiB

    columns = [Column("phase"), Column("device"), Column("metric")]
    columns += [Column(f"{name} MiB", numeric=True) for name in ("start", "peak", "end", "delta")]
    cells = []
    for i, r in enumerate(rows):
        cells.append(
            [r["phase"], r["device"], r["metric"]]
            + [f"{r[k] / MiB:,.1f}" for k in ("start", "peak", "end")]
            + [f"{r['delta'] / MiB:+,.1f}"]
        )
        if i + 1 == len(rows) or rows[i + 1]["phase"] != r["phase"]:
            cells += [[f"· {m['mark']}", m["device"], m["metric"], "", f"{m['peak'] / MiB:,.1f}", "", ""]
                      for m in marks if m["phase"] == r["phase"]]  # fmt: skip
    return Table(columns, cells, title=title)


# a tool-calling step's figures (StepResult's tool metrics, TRL's tools/call_frequency and tools/failure_frequency)
TOOL_COLUMNS = ("tool calls/row", "failed/row", "failed %", "turns/row")
# a vllm rollout's prompt tokens read from its prefix cache (StepResult.prefix_cache_hit_rate; hf has none: no column)
PREFIX_COLUMN = "prefix cache hit"


def rollout_columns(history) -> list[str]:
    """The columns the steps of `history` have figures for: the tool columns where a step called tools, the prefix
    cache's hit rate where a step measured it."""
    tools = any(r.tool_calls_per_row is not None for r in history)
    cached = any(r.prefix_cache_hit_rate is not None for r in history)
    return [*TOOL_COLUMNS] * tools + [PREFIX_COLUMN] * cached


def tool_cells(result, names=TOOL_COLUMNS) -> list[str]:
    """A step's figures under `names` (rollout_columns): calls per row, failed calls per row, the failed share, turns
    per row; the prefix cache's hit rate. "-" where the step lacks the figure (a resumed run on another backend)."""
    calls, failed, rate = result.tool_calls_per_row, result.tool_failure_frequency, result.prefix_cache_hit_rate
    cells = {} if rate is None else {PREFIX_COLUMN: f"{rate:.0%}"}
    if calls is not None:
        figures = [f"{calls:.2f}", f"{calls * failed:.2f}", f"{failed:.0%}", f"{result.turns_mean:.2f}"]
        cells.update(zip(TOOL_COLUMNS, figures))
    return [cells.get(name, "-") for name in names]


def tool_table(history) -> Table | None:
    """Tool calls and failures per step (one row each) and the prefix cache's hit rate, where the steps have them; None
    when no step called tools or measured its prefix cache."""
    names = rollout_columns(history)
    rows = [[str(r.step), *cells] for r in history if set(cells := tool_cells(r, names)) - {"-"}]
    if not rows:
        return None
    columns = [Column("step", numeric=True)] + [Column(name, numeric=True) for name in names]
    title = "tool calls and failures per step" if TOOL_COLUMNS[0] in names else "prefix cache hits per step"
    return Table(columns, rows, title=title)


class MemoryTable(str):
    """`lab.memory_table()`: the text `print()` shows and callers search (memory.format_table, as ever); on its own in a
    cell, an HTML table (and that same text, unquoted, as its plain-text form)."""

    def __new__(cls, rows: list[dict], step: int | None = None, marks: list[dict] = ()):
        """`marks`: the step's marks inside phases (MemorySampler.mark_rows: a tool loop's turns), under their phase."""
        made = super().__new__(cls, format_table(rows, marks))
        made.rows, made.step, made.marks = rows, step, list(marks)
        return made

    def __repr__(self) -> str:  # why: a str's repr is the quoted text with its literal \n
        return str(self)

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        title = "memory per phase (MiB)" if self.step is None else f"step {self.step}: memory per phase (MiB)"
        return phase_table(self.rows, title, self.marks).html()


def format_table(rows: list[dict], marks: list[dict] = ()) -> str:
    """The per-phase table of one step, in MiB: one line per phase x device x metric; after a phase's lines, its
    marks' (`marks`: MemorySampler.mark_rows, a tool loop's turns), indented, with their peak alone."""
    w = max([9, *(len(r["device"]) + 1 for r in rows)])  # a sharded Lab's devices are longer: 'rank1/cuda:1'
    lines = [f"{'phase':<11}{'device':<{w}}{'metric':<12}{'start':>10}{'peak':>10}{'end':>10}{'delta':>10}"]
    for i, r in enumerate(rows):
        lines.append(
            f"{r['phase']:<11}{r['device']:<{w}}{r['metric']:<12}{r['start'] / MiB:>10.1f}"
            f"{r['peak'] / MiB:>10.1f}{r['end'] / MiB:>10.1f}{r['delta'] / MiB:>+10.1f}"
        )
        if i + 1 == len(rows) or rows[i + 1]["phase"] != r["phase"]:  # the phase's last line: its marks after it
            for m in (m for m in marks if m["phase"] == r["phase"]):
                label = "  " + m["mark"]
                lines.append(f"{label:<11}{m['device']:<{w}}{m['metric']:<12}{'':>10}{m['peak'] / MiB:>10.1f}")
    return "\n".join(lines)


def peak_rows(rows: list[dict]) -> list[dict]:
    """Per phase x device x metric, the row (of any step) with the highest peak: a run's table in one."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["phase"], r["device"], r["metric"])
        if key not in best or r["peak"] > best[key]["peak"]:
            best[key] = r
    return list(best.values())


def format_compact(rows: list[dict], title: str = "memory MiB") -> str:
    """One line per phase: each device/metric as 'peak (delta)' MiB, for the CLI."""
    keys = list(dict.fromkeys((r["device"], r["metric"]) for r in rows))
    by_phase: dict[str, dict] = {}
    for r in rows:
        by_phase.setdefault(r["phase"], {})[(r["device"], r["metric"])] = r
    head = f"  {title:<12}" + "".join(f"{d + ' ' + m + ' peak (delta)':>28}" for d, m in keys)
    lines = [head]
    for phase, cells in by_phase.items():
        lines.append(
            f"  {phase:<11} "
            + "".join(
                f"{cells[k]['peak'] / MiB:>18.1f} ({cells[k]['delta'] / MiB:+7.1f})" if k in cells else " " * 28
                for k in keys
            )
        )
    return "\n".join(lines)
