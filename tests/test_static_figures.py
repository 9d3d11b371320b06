"""memory/static.png draws grpo_lab's plotly figures with matplotlib: PNG bytes of the asked width and the figure's
height, whose pixels follow the data (a scatter + bar figure, the memory timeline, the frontier's subplots).
Issue 51 item 4: a timeline's phases are keyed and labelled, idle is squeezed into labelled gaps, no line hides an
identical one, a PNG fits a notebook's output width and reads on a light and a dark theme, the live figure beside it
too, a PNG says nothing about hovering, and notebook 04's real-model chart draws the capacity it judges against."""

from __future__ import annotations

import io
from pathlib import Path

import plotly.graph_objects as go
import pytest
from PIL import Image

from grpo_lab import load_config
from grpo_lab.memory.figures import timeline_figure
from grpo_lab.memory.readers import MiB
from grpo_lab.memory.static import WIDTH, png
from grpo_lab.planner import frontier

MAGIC = b"\x89PNG\r\n\x1a\n"


def image(data: bytes) -> Image.Image:
    assert data.startswith(MAGIC)
    return Image.open(io.BytesIO(data)).convert("RGB")


def red_pixels(img: Image.Image) -> int:
    return sum(1 for r, g, b in img.getdata() if r > 200 and g < 60 and b < 60)


def scatter_and_bars(bars, height=None):
    fig = go.Figure(
        [
            go.Scatter(x=[0, 1, 2], y=[1, 3, 2], name="line", mode="lines+markers"),
            go.Bar(x=["a", "b", "c"], y=bars, name="bars", marker=dict(color="#ff0000")),
        ]
    )
    fig.update_layout(title="scatter and bars", height=height, yaxis=dict(title="MiB"))
    return fig


def test_a_scatter_and_bar_figure_is_a_png_of_the_asked_size_whose_bars_follow_the_data():
    tall = png(scatter_and_bars([3, 3, 3], height=300), width=640)
    assert image(tall).size == (640, 300)
    assert image(png(scatter_and_bars([3, 3, 3]))).size == (WIDTH, 420)  # defaults: WIDTH, 420 without a height
    short = png(scatter_and_bars([1, 1, 3], height=300), width=640)
    assert short != tall
    assert red_pixels(image(short)) < 0.75 * red_pixels(image(tall))  # two of three bars a third as high
    assert red_pixels(image(short)) > 0


def samples(rss_mib: float, gpu_mib: float, n: int = 20):
    """A synthetic step: host rss/used lines and a GPU's ledger (allocated + cached), rollout then backward."""
    out = []
    for i in range(n):
        t, phase = i * 0.1, "rollout" if i < n // 2 else "backward"
        out.append((t, 0, phase, "host", "rss", (rss_mib + 10 * i) * MiB))
        out.append((t, 0, phase, "host", "used", (rss_mib + 400 + 5 * i) * MiB))
        out.append((t, 0, phase, "cuda:0", "allocated", (gpu_mib + i) * MiB))
        out.append((t, 0, phase, "cuda:0", "cached", 50 * MiB))
    return out


MARKS = [(0, "rollout", 0.0, 0.95), (0, "backward", 1.0, 1.9)]
LIMITS = {"host limit": 1200.0, "host threshold 95%": 1140.0}


def test_the_memory_timeline_is_a_png_that_changes_with_its_samples_and_limits():
    fig = timeline_figure(samples(500, 100), MARKS, LIMITS)
    height = fig.layout.height
    drawn = png(fig)
    assert image(drawn).size == (WIDTH, height)
    assert png(timeline_figure(samples(500, 100), MARKS, LIMITS)) == drawn  # the same data, the same bytes
    assert png(timeline_figure(samples(300, 100), MARKS, LIMITS)) != drawn  # other host samples
    assert png(timeline_figure(samples(500, 400), MARKS, LIMITS)) != drawn  # another GPU stack
    assert png(timeline_figure(samples(500, 100), MARKS, {})) != drawn  # no limits
    for kind in ("line", "rect"):  # the same figure without its limit lines, or without its phase bands
        bare = go.Figure(fig)
        bare.layout.shapes = [s for s in fig.layout.shapes if s.type != kind]
        assert len(bare.layout.shapes) < len(fig.layout.shapes)
        assert png(bare) != drawn, kind


def panel_columns(img: Image.Image) -> list[int]:
    """Columns (x pixels) with a saturated heatmap colour (green to red: far from grey) in the plot's middle row."""
    y = img.height // 2
    return [x for x in range(img.width) if max(img.getpixel((x, y))) - min(img.getpixel((x, y))) > 80]


def frontier_of(lengths: str):
    """The 7B preset's frontier, its host pinned at 64 GiB (so its cells do not depend on this machine's RAM)."""
    config = load_config("qwen2.5-7b-nf4-24gb", ["placement.host_memory_gib=64"])
    return frontier(config, lengths=lengths, micro_batches="1,2").figure()


@pytest.fixture(scope="module")
def frontier_figure():
    return frontier_of("256,512")


def test_the_frontiers_subplots_are_drawn_side_by_side(frontier_figure):
    layout = frontier_figure.layout
    domains = [layout[f"xaxis{s}"].domain for s in ("", "2", "3") if layout[f"xaxis{s}"] is not None]
    assert len(domains) >= 2  # one heatmap panel per micro-batch shown
    img = image(png(frontier_figure))
    assert img.size == (WIDTH, layout.height)
    columns = panel_columns(img)
    # each panel's part of the page (png's 7% margin, 88% width) is mostly heatmap cells; the gaps between are not
    edges = [(int(WIDTH * (0.07 + 0.88 * left)), int(WIDTH * (0.07 + 0.88 * right))) for left, right in domains]
    for lo, hi in edges:
        assert sum(lo <= x < hi for x in columns) > 0.5 * (hi - lo), (lo, hi)
    for (_, gap_lo), (gap_hi, _) in zip(edges, edges[1:]):
        assert sum(gap_lo <= x < gap_hi for x in columns) < 0.1 * (gap_hi - gap_lo), (gap_lo, gap_hi)
    assert png(frontier_of("256,1024")) != png(frontier_figure)


# --- issue 51 item 4: what a saved timeline must show, and how every PNG meets a notebook's theme and width


@pytest.fixture
def drawn(monkeypatch):
    """png() of a figure with the matplotlib Figure it saved (caught at savefig, however png builds it)."""
    from matplotlib.figure import Figure

    saved, save = [], Figure.savefig

    def keep(self, *args, **kwargs):
        saved.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)

    def draw(fig, **kwargs):
        data = png(fig, **kwargs)
        return saved[-1], data

    return draw


def texts(canvas) -> list:
    """Every visible, non-empty text on the canvas (titles, tick labels, legend entries, annotations)."""
    from matplotlib.text import Text

    return [t for t in canvas.findobj(Text) if t.get_visible() and t.get_text().strip()]


def legend_labels(canvas) -> list[str]:
    legends = list(canvas.legends) + [ax.get_legend() for ax in canvas.axes if ax.get_legend()]
    return [t.get_text() for legend in legends for t in legend.get_texts()]


def band_label_texts(canvas) -> list[str]:
    return [t.get_text() for ax in canvas.axes for t in ax.texts]


PHASED = [(0, "rollout", 0.0, 0.6), (0, "rewards", 0.6, 0.62), (0, "backward", 0.62, 1.2), (0, "optimizer", 1.2, 1.9)]


def test_a_timeline_png_keys_every_phase_colour_and_labels_the_bands_wide_enough(drawn):
    canvas, _ = drawn(timeline_figure(samples(500, 100), PHASED, LIMITS))
    assert {"rollout", "rewards", "backward", "optimizer"} <= set(legend_labels(canvas))  # one patch per colour
    labels = band_label_texts(canvas)
    assert {"rollout", "backward", "optimizer", "step 0"} <= set(labels), labels  # written on the bands
    assert "rewards" not in labels  # 1 % of the run: too narrow to write on, named by the key


def idle_run():
    """Loading for 300 s, a 2 s step, 240 s idle, a 2 s step, then 10 s idle until the snapshot."""
    marks, t = [], 300.0
    for step in range(2):
        marks += [(step, "rollout", t, t + 1.5), (step, "backward", t + 1.5, t + 2.0)]
        t += 2.0 + 240.0
    end = t - 230.0
    rows = [(i * 0.5, 0, "", "host", "rss", (600 + i % 7) * MiB) for i in range(int(end * 2) + 1)]
    return rows, marks


def test_idle_time_and_loading_are_squeezed_into_gaps_that_say_how_long_they_were(drawn):
    rows, marks = idle_run()
    fig = timeline_figure(rows, marks, {})
    canvas, _ = drawn(fig)
    lo, hi = canvas.axes[0].get_xlim()
    assert 4.0 / (hi - lo) > 0.5, (lo, hi)  # the 4 s of work fill most of the axis, not 1 % of 546 s
    bands = [s for s in fig.layout.shapes if s.type == "rect" and s.name in ("rollout", "backward")]
    assert [round(b.x1 - b.x0, 6) for b in bands] == [1.5, 0.5, 1.5, 0.5]  # a phase keeps the width it ran
    labels = band_label_texts(canvas)
    assert {"load + idle 300 s", "idle 240 s", "idle 10 s"} <= set(labels), labels
    assert "squeezed" in canvas.axes[0].get_xlabel() and "idle (squeezed)" in legend_labels(canvas)


def test_two_ranks_that_hold_the_same_are_both_seen(drawn):
    """Notebook 06's timeline: rank0's line lay under rank1's (they hold about the same). Each rank has a dash of its
    own, in the live figure and in its PNG."""
    rows, marks = idle_run()
    rows += [(t, s, p, f"rank{k}/host", "used", v + k * MiB) for t, s, p, _, _, v in rows[:600] for k in (0, 1)]
    fig = timeline_figure(rows, marks, {"rank0, rank1 line (95% of its budget)": 800.0})
    styles = {t.name: (t.line.dash or "solid") for t in fig.data if t.name.startswith("rank")}
    assert len(set(styles.values())) == 2, styles
    canvas, _ = drawn(fig)
    drawn_styles = {line.get_label(): line.get_linestyle() for ax in canvas.axes for line in ax.get_lines()}
    assert len({drawn_styles[name] for name in styles}) == 2, drawn_styles


def test_a_rolled_back_attempt_is_marked_undone_beside_its_redo(drawn):
    """No figure marked the attempt a story undid: the sampler keeps the marks of the phases a rollback retires, and
    the timeline draws each as a red band with "undone" at its top, in the live figure and its PNG; the redo is
    drawn as any phase."""
    from grpo_lab.memory.sampler import MemorySampler

    sampler = MemorySampler(["cpu"], hz=0, host_threshold=0.95)
    sampler.marks = [(0, "rollout", 0.0, 1.0), (0, "backward", 1.0, 2.0)]
    sampler.retire(0, ["backward"], 1)  # the step rolled back its backward
    sampler.marks.append((0, "backward", 2.0, 3.0))  # the redo
    assert sampler.undone == [(0, "backward", 1.0, 2.0)]
    sampler.retire(0, ["rollout", "backward"], 2)  # a second rollback: the redo is undone too, nothing twice
    assert sampler.undone == [(0, "backward", 1.0, 2.0), (0, "rollout", 0.0, 1.0), (0, "backward", 2.0, 3.0)]
    fig = timeline_figure(samples(500, 100, n=40), sampler.marks, LIMITS, sampler.undone[:1])
    undone = [s for s in fig.layout.shapes if s.name == "undone attempt"]
    assert [(u.x0, u.x1) for u in undone] == [(1.0, 2.0)]
    assert [a.x for a in fig.layout.annotations if a.text == "undone"] == [1.5]
    canvas, _ = drawn(fig)
    assert "undone attempt" in legend_labels(canvas) and "undone" in band_label_texts(canvas)


def same_rss_and_used(above: float = 0.0):
    """Host samples whose `used` is the RSS (as under placement.host_memory_gib), or `above` MiB more."""
    out = []
    for i in range(20):
        rss = (500 + 10 * i) * MiB
        out += [(i * 0.1, 0, "rollout", "host", "rss", rss), (i * 0.1, 0, "rollout", "host", "used", rss + above * MiB)]
    return out


def data_lines(canvas) -> list:
    """The series drawn as lines (not the limit lines across the plot, not the step separators)."""
    return [line for line in canvas.axes[0].lines if len(set(line.get_xdata())) > 1 and line.get_linestyle() == "-"]


def test_a_host_line_identical_to_another_is_drawn_once_named_for_both_and_the_limits_lie_on_top(drawn):
    fig = timeline_figure(same_rss_and_used(), MARKS, {"host threshold 95%": 640.0})
    assert [t.name for t in fig.data] == ["host rss (= host used)"]
    canvas, _ = drawn(fig)
    series = [tuple(map(tuple, line.get_xydata())) for line in data_lines(canvas)]
    assert len(series) == len(set(series)) == 1  # no line under an identical one
    limits = [line for line in canvas.axes[0].lines if line.get_linestyle() == "--"]
    assert limits and min(x.get_zorder() for x in limits) > max(x.get_zorder() for x in data_lines(canvas))
    apart = timeline_figure(same_rss_and_used(400.0), MARKS, {})
    assert [t.name for t in apart.data] == ["host rss", "host used"]  # different lines both stay


def test_every_png_fits_a_notebooks_output_width(monkeypatch):
    """JupyterLab's output area is about 830 px wide, and plotly's renderer shows the PNG at its pixel size."""
    from grpo_lab.memory import static

    shown = []
    monkeypatch.setattr("IPython.display.display", lambda bundle, raw=False: shown.append(bundle))
    monkeypatch.setenv("GRPO_LAB_LIVE_WIDGETS", "0")  # headless: the PNG form
    static.show(timeline_figure(samples(500, 100), MARKS, LIMITS))
    static.show(scatter_and_bars([1, 2, 3]))
    assert len(shown) == 2
    assert all(image(b["image/png"]).width <= 800 for b in shown), [image(b["image/png"]).size for b in shown]


def contrast(colour, background) -> float:
    from matplotlib.colors import to_rgb

    def luminance(rgb):
        lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((luminance(to_rgb(colour)), luminance(to_rgb(background))), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("figure", ["timeline", "bars"])
def test_a_png_is_transparent_and_its_text_reads_on_a_light_and_a_dark_theme(figure, drawn):
    """No white block under JupyterLab Dark: the background is the theme's, the text one grey readable on both (white
    and JupyterLab Dark's #111)."""
    fig = timeline_figure(samples(500, 100), PHASED, LIMITS) if figure == "timeline" else scatter_and_bars([1, 2, 3])
    canvas, data = drawn(fig)
    rgba = Image.open(io.BytesIO(data)).convert("RGBA")
    alpha = rgba.getchannel("A")
    corners = [(0, 0), (rgba.width - 1, 0), (0, rgba.height - 1), (rgba.width - 1, rgba.height - 1)]
    assert all(alpha.getpixel(c) == 0 for c in corners)  # the margins are the theme's background
    assert sum(a < 255 for a in alpha.getdata()) > 0.5 * rgba.width * rgba.height
    worst = {bg: min(contrast(t.get_color(), bg) for t in texts(canvas)) for bg in ("#ffffff", "#111111")}
    assert all(ratio >= 4.0 for ratio in worst.values()), worst


def test_show_gives_the_live_figure_the_pngs_transparent_look(monkeypatch):
    """A person's frontend gets the live figure (plotly's JupyterLab renderer), with the PNG's look."""
    from grpo_lab.memory import static

    shown = []
    monkeypatch.setattr("IPython.display.display", lambda bundle, raw=False: shown.append(bundle))
    monkeypatch.setenv("GRPO_LAB_LIVE_WIDGETS", "1")
    static.show(timeline_figure(samples(500, 100), MARKS, LIMITS))
    layout = shown[0]["application/vnd.plotly.v1+json"]["layout"]
    assert layout["paper_bgcolor"] == layout["plot_bgcolor"] == "rgba(0,0,0,0)"
    assert contrast(layout["font"]["color"], "#ffffff") >= 4.0 and contrast(layout["font"]["color"], "#111111") >= 4.0


def test_a_png_says_nothing_about_hovering(frontier_figure, drawn):
    assert "hover a cell" in frontier_figure.layout.title.text  # the live figure's hint
    canvas, _ = drawn(frontier_figure)
    assert not [t.get_text() for t in texts(canvas) if "hover" in t.get_text().lower()]


def test_a_frontier_png_writes_each_cells_percentage_as_the_live_heatmap_does(frontier_figure, drawn):
    """The live heatmap writes peak / capacity in each cell (its text, texttemplate "%{text}", while the colour is
    peak / its line); the PNG a saved notebook keeps wrote none, so a reader saw colours without their numbers.
    Refused (grey) cells have no number."""
    canvas, _ = drawn(frontier_figure)
    written = [t.get_text() for t in texts(canvas)]
    colour = [t for t in frontier_figure.data if t.texttemplate]
    want = [label for t in colour for row in t.text for label in row if label]
    assert want and sorted(w for w in written if w in set(want)) == sorted(want)


def test_04s_real_model_chart_draws_the_capacity_it_judges_against(drawn):
    """Notebook 04's real-model bar chart, run from the notebook's own cell (plan() only: nothing loads)."""
    import nbformat

    from grpo_lab.planner import plan

    notebook = nbformat.read(Path(__file__).parents[1] / "notebooks" / "04_logprob_memory.ipynb", as_version=4)
    index, cell = next((i, c) for i, c in enumerate(notebook.cells) if "real = {}" in c.source)
    shown = []
    story = type("Story", (), {"fact": lambda self, name, value: value})()
    scope = dict(plan_config="qwen2.5-7b-nf4-24gb", failing_head="full", fixed_head="chunked", story=story)
    namespace = dict(scope, load_config=load_config, plan=plan, show=shown.append)
    exec(cell.source, namespace)
    (fig,) = shown
    capacity = next(iter(namespace["real"].values()))[2]
    lines = [s for s in fig.layout.shapes if s.type == "line" and s.y0 == s.y1 == capacity]
    assert lines and lines[0].x0 == 0 and lines[0].x1 == 1, fig.layout.shapes  # across the plot at the capacity
    canvas, _ = drawn(fig)
    drawn_at = [line.get_ydata()[0] for line in canvas.axes[0].lines if line.get_linestyle() == "--"]
    assert drawn_at == [pytest.approx(capacity)]
    assert any("capacity" in t for t in band_label_texts(canvas))  # named on the plot
    caption = notebook.cells[index - 1].source
    assert "capacity" in caption and "hover" not in caption.lower()


def test_a_legend_of_long_names_stays_whole_inside_the_png(drawn):
    """Notebook 06's P3 timeline: the host's and two ranks' merged lines, every phase, an undone attempt and idle
    gaps made a five-column legend wider than the PNG, cut at both ends ("idle (squeez"); the columns now fit."""
    rows = []
    for i in range(40):
        for device in ("host", "rank0/host", "rank1/host"):
            value = (500 + 10 * i + (0 if device == "host" else 900)) * MiB
            above = 300 * MiB if device == "host" else 0  # the machine's used RAM is more than the Lab's RSS
            rows += [(i * 0.1, 0, "", device, "rss", value), (i * 0.1, 0, "", device, "used", value + above)]
    phases = ["rollout", "rewards", "advantages", "logprobs", "backward", "optimizer", "sync"]
    marks = [(0, p, 2.0 + i * 0.25, 2.2 + i * 0.25) for i, p in enumerate(phases)]
    fig = timeline_figure(rows, marks, {"rank0, rank1 line (95% of its budget)": 1500.0}, [(0, "rollout", 1.0, 1.9)])
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas, _ = drawn(fig)
    agg = FigureCanvasAgg(canvas)
    agg.draw()  # where the constrained layout put the legend, as savefig drew it
    renderer = agg.get_renderer()
    (legend,) = canvas.legends
    box, page = legend.get_window_extent(renderer), canvas.bbox
    assert {"idle (squeezed)", "undone attempt", "rank1/host rss (= rank1/host used)"} <= set(legend_labels(canvas))
    assert box.x0 >= page.x0 and box.x1 <= page.x1, (box, page)
