"""memory/static.png draws grpo_lab's plotly figures with matplotlib: PNG bytes of the asked width and the figure's
height, whose pixels follow the data (a scatter + bar figure, the memory timeline, the frontier's subplots)."""

from __future__ import annotations

import io

import plotly.graph_objects as go
import pytest
from PIL import Image

from grpo_lab import load_config
from grpo_lab.memory.figures import timeline_figure
from grpo_lab.memory.readers import MiB
from grpo_lab.memory.static import png
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
    assert image(png(scatter_and_bars([3, 3, 3]))).size == (900, 420)  # defaults: 900 wide, 420 without a height
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
    assert image(drawn).size == (900, height)
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
    assert img.size == (900, layout.height)
    columns = panel_columns(img)
    # each panel's part of the page (png's 7% margin, 88% width) is mostly heatmap cells; the gaps between are not
    edges = [(int(900 * (0.07 + 0.88 * left)), int(900 * (0.07 + 0.88 * right))) for left, right in domains]
    for lo, hi in edges:
        assert sum(lo <= x < hi for x in columns) > 0.5 * (hi - lo), (lo, hi)
    for (_, gap_lo), (gap_hi, _) in zip(edges, edges[1:]):
        assert sum(gap_lo <= x < gap_hi for x in columns) < 0.1 * (gap_hi - gap_lo), (gap_lo, gap_hi)
    assert png(frontier_of("256,1024")) != png(frontier_figure)
