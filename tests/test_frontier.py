"""The fit frontier (planner/frontier.py): every cell is plan() of its combination (fits, binding device, peak, phase,
headroom), cells get heavier with length and group size, a combination the config refuses is a grey cell with its
reason, the current point is marked; `grpo-lab plan --frontier` writes the page (its absolute path printed) and bad
input is one line, exit 2, nothing written; the page read in headless Chromium (screenshot in .artifacts/frontier/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from html_pages import needs_chromium, opened

from grpo_lab.cli import main
from grpo_lab.config.loading import load_config
from grpo_lab.errors import LabError
from grpo_lab.planner import frontier, plan
from grpo_lab.planner.grid import FIELDS, parse_range
from grpo_lab.planner.render import size

pytestmark = pytest.mark.xdist_group("frontier")  # why: its tests share module-scoped state: one worker builds it

PRESET = "qwen2.5-7b-nf4-24gb"
# the 7B preset on its 24 GiB GPU with 512-token prompts, the whole batch in one backward pass and one generate
# call, so both the completion length and the group size move the peak; the host given too, so nothing depends on
# this machine
WHOLE = [
    "grpo.micro_batch_size=null",
    "generator.chunk_size=null",
    "generator.max_prompt_length=512",
    "placement.host_memory_gib=64",
]
LENGTHS, GENERATIONS = [64, 128, 256, 512, 768, 1024], [1, 2, 4, 8, 16]  # G 1: the config refuses it (needs >= 2)


def config():
    return load_config(PRESET, WHOLE)


@pytest.fixture(scope="module")
def front():
    return frontier(config(), generations=[1, 2, 4, 8, 16], micro_batches=[2])


def planned(point):
    """plan() of the config at (length, generations, micro-batch), and its binding device: built here, not by the
    frontier's code."""
    overrides = [f"{field}={'null' if value is None else value}" for field, value in zip(FIELDS, point)]
    result = plan(load_config(config(), overrides))
    return result, max(result.devices.values(), key=lambda d: d.fraction / d.line)


def test_every_cell_is_the_plan_of_its_combination(front):
    assert (front.lengths, front.generations, front.micro_batches) == (LENGTHS, GENERATIONS, [2, None])
    assert front.current == (768, 8, None) and len(front.cells) == 6 * 5 * 2
    for c in front.cells:
        if c.generations == 1:
            assert c.refused.startswith("grpo.num_generations: got 1") and "\n" not in c.refused
            continue
        result, d = planned(c.point)
        assert c.refused is None
        assert (c.fits, c.device, c.peak, c.phase) == (result.fits, d.device, d.total, d.peak_phase), c
        assert (c.headroom, c.fraction) == (d.line_bytes - d.total, d.fraction)


def test_cells_get_heavier_with_length_and_generations_and_both_verdicts_show(front):
    for micro in front.micro_batches:
        grid = [[front.cell(length, g, micro) for length in LENGTHS] for g in GENERATIONS[1:]]
        for row in grid:
            assert [c.peak for c in row] == sorted(c.peak for c in row)
        for column in zip(*grid):
            assert [c.peak for c in column] == sorted(c.peak for c in column)
    whole = [c for c in front.cells if c.micro_batch is None and not c.refused]
    assert front.cell(1024, 16, None).peak > 3 * front.cell(64, 2, None).peak
    assert {c.fits for c in whole} == {True, False}
    assert {c.device for c in whole} == {"cuda:0"} and {c.phase for c in whole} == {"backward"}
    # a cell that does not fit has no fitting cell above or right of it (heavier in both)
    for c in whole:
        if not c.fits:
            assert not any(o.fits for o in whole if o.length >= c.length and o.generations >= c.generations)


def test_the_table_and_figure_mark_the_current_point_and_show_every_cell(front):
    text = str(front)
    assert text.splitlines()[0] == "Fit frontier: Qwen/Qwen2.5-7B-Instruct on cuda:0 24.00 GiB, host 64.00 GiB"
    assert "grpo.micro_batch_size whole batch *" in text and " 768*" in text and "\n    8*  " in text
    now = front.cell(768, 8, None)
    assert (
        not now.fits
        and f"current: length 768, G 8, micro-batch whole batch: does not fit, cuda:0 {now.fraction:.0%}" in text
    )
    assert "refused (12 cells, e.g. length 64, G 1, micro-batch 2): grpo.num_generations: got 1" in text
    row = next(line for line in text.splitlines() if line.startswith("    16  "))  # the first block: micro-batch 2
    assert row.split()[1:3] == ["ok", f"{front.cell(64, 16, 2).fraction:.0%}"]
    fig = front.figure()
    assert [t.name for t in fig.data] == ["refused", "micro-batch 2", "refused", "micro-batch whole batch"]
    colour = fig.data[1]  # x the lengths, y the group sizes, z[row][column] that cell's peak over its line
    assert (list(colour.x), list(colour.y)) == ([str(v) for v in LENGTHS], [str(v) for v in GENERATIONS])
    assert colour.z[4][0] == front.cell(64, 16, 2).of_line and colour.z[1][5] == front.cell(1024, 2, 2).of_line
    (shape,), annotation = fig.layout.shapes, fig.layout.annotations[-1]
    assert (annotation.text, annotation.xref, annotation.yref) == ("<b>current</b>", "x2", "y2")
    assert (LENGTHS[annotation.x], GENERATIONS[annotation.y]) == (768, 8)
    assert (shape.xref, shape.x0, shape.x1, shape.y0, shape.y1) == ("x2", 3.5, 4.5, 2.5, 3.5)


def test_default_axes_add_the_configs_own_values():
    front = frontier(load_config(PRESET, ["placement.host_memory_gib=64"]))
    assert (front.lengths, front.generations, front.micro_batches) == (LENGTHS, [2, 4, 8, 16], [4])
    long = frontier(
        load_config(
            PRESET, ["placement.host_memory_gib=64", "generator.max_completion_length=3000", "grpo.num_generations=6"]
        ),
        micro_batches="1:2",
    )
    assert long.lengths == [64, 128, 256, 512, 1024, 2048, 3000] and long.generations == [2, 4, 6, 8, 16]
    assert long.micro_batches == [1, 2, 4] and long.current == (3000, 6, 4)


def test_what_is_wrong_for_every_cell_is_one_error_not_a_grey_grid():
    from grpo_lab.checks.devices import cuda_device_count

    if cuda_device_count():
        pytest.skip("this machine has a cuda:0 to plan on")
    with pytest.raises(LabError, match="^placement.gpu_memory_gib: cuda:0 is not on this machine"):
        frontier(load_config(PRESET, ["placement.gpu_memory_gib=null"]))


@pytest.mark.parametrize(
    "text, values",
    [
        ("64,128,64", [64, 128]),
        (" 256, 64 ", [64, 256]),
        ("64:1024", LENGTHS[:4] + [1024]),
        ("48:400", [48, 96, 192, 384]),
        ("8:8", [8]),
    ],
)
def test_parse_range(text, values):
    assert parse_range(text, "--lengths") == values


@pytest.mark.parametrize(
    "text, problem",
    [
        ("", "empty"),
        ("  ", "empty"),
        ("1024:64", "inverted (1024 > 64)"),
        ("0", "got 0"),
        ("64:0", "got 0"),
        ("-2", "got -2"),
        ("64,,128", "empty item"),
        ("64:", "'' is not a whole number"),
        ("1.5", "not a whole number"),
    ],
)
def test_parse_range_refuses_in_one_line_naming_the_flag(text, problem):
    with pytest.raises(LabError) as err:
        parse_range(text, "--lengths")
    assert str(err.value).startswith("--lengths: ") and problem in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"lengths": []}, "lengths: empty"),
        ({"generations": [4, 0]}, "generations: got 0"),
        ({"micro_batches": "4:2"}, "micro_batches: '4:2' is inverted"),
        ({"lengths": [True]}, "lengths: got True"),
    ],
)
def test_frontier_refuses_bad_ranges_naming_the_argument(kwargs, problem):
    with pytest.raises(LabError, match=problem):
        frontier(config(), **kwargs)


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpo-lab: error: ") and "\n" not in err
    return err


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--frontier", "--lengths", ""], "--lengths: empty"),
        (["--frontier", "--lengths", "1024:64"], "--lengths: '1024:64' is inverted"),
        (["--frontier", "--generations", "0"], "--generations: got 0"),
        (["--frontier", "--micro-batches", "2,x"], "--micro-batches: 'x' is not a whole number"),
        (["--out", "page.html"], "--out: only with --frontier"),
        (["--lengths", "64:256"], "--lengths: only with --frontier"),
        (["--frontier", "--out", "."], "is a directory"),
        (["--frontier", "--set", "grpo.beta=-1"], "grpo.beta"),
    ],
)
def test_bad_frontier_input_is_one_line_exit_2_and_writes_nothing(args, problem, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert problem in _one_line_error(capsys, ["plan", PRESET, *args])
    assert list(tmp_path.iterdir()) == []  # no page, no temporary file


def test_cli_frontier_prints_the_table_and_the_pages_absolute_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = [
        "plan",
        PRESET,
        *[a for o in WHOLE for a in ("--set", o)],
        "--frontier",
        "--generations",
        "1:16",
        "--micro-batches",
        "2",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (
        out
        == str(frontier(config(), generations="1:16", micro_batches=[2])) + "\n"
        + f"frontier page: open {tmp_path / 'frontier.html'} in a browser (hover a cell for its binding device, peak, "
        "phase and headroom)\n"
    )
    assert main(["plan", PRESET, "--frontier", "--out", "sub/f.html"]) == 0  # a relative --out, its folder made
    assert f"open {tmp_path / 'sub' / 'f.html'} in a browser" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["f.html", "frontier.html", "sub"]
    assert main(["plan", PRESET]) == 0 and "frontier" not in capsys.readouterr().out  # the plain plan as before


READ_PAGE = """() => {
    const gd = document.querySelector('.plotly-graph-div');
    return {traces: gd.data.map(t => ({name: t.name, x: t.x, y: t.y, z: t.z, text: t.text, customdata: t.customdata,
                                       xaxis: t.xaxis || 'x'})),
            annotations: gd.layout.annotations.map(a => ({text: a.text, x: a.x, y: a.y, xref: a.xref})),
            shapes: gd.layout.shapes.map(s => ({name: s.name, x0: s.x0, y0: s.y0, xref: s.xref})),
            title: gd.layout.title.text, table: document.getElementById('frontier-table').textContent};
}"""

HOVER = """([xaxis, yaxis, col, row]) => {
    const l = document.querySelector('.plotly-graph-div')._fullLayout, x = l[xaxis], y = l[yaxis];
    return [x._offset + x.l2p(col), y._offset + y.l2p(row)];
}"""


@needs_chromium
def test_the_page_in_chromium_agrees_with_plan_per_combination(front, tmp_path):
    path = front.to_html(tmp_path / "frontier.html")
    assert path.is_absolute() and not re.search(r"<script[^>]*\bsrc=", path.read_text())  # plotly.js inlined: offline
    with opened(path, "frontier/frontier.png") as page:
        seen = page.evaluate(READ_PAGE)
        current = next(a for a in seen["annotations"] if "current" in a["text"])
        page.mouse.move(*page.evaluate(HOVER, ["xaxis2", "yaxis2", current["x"], current["y"]]))
        page.wait_for_selector(".hoverlayer .hovertext")
        hovered = page.evaluate("() => document.querySelector('.hoverlayer .hovertext').textContent")  # (SVG)
    assert "Qwen/Qwen2.5-7B-Instruct" in seen["title"] and "cuda:0 24.00 GiB" in seen["title"]
    assert seen["table"].strip() == str(front)
    traces = seen["traces"]
    assert [t["name"] for t in traces] == ["refused", "micro-batch 2", "refused", "micro-batch whole batch"]
    for (refused, colour), micro in zip([traces[0:2], traces[2:4]], [2, None]):
        assert [int(v) for v in colour["x"]] == LENGTHS and [int(v) for v in colour["y"]] == GENERATIONS
        for i, g in enumerate(GENERATIONS):
            for j, length in enumerate(LENGTHS):
                hover = colour["customdata"][i][j]
                assert refused["text"][i][j] == hover
                if g == 1:
                    assert colour["z"][i][j] is None and refused["z"][i][j] is not None
                    assert "<b>refused</b>: grpo.num_generations: got 1" in hover
                    continue
                result, d = planned((length, g, micro))
                assert refused["z"][i][j] is None and colour["z"][i][j] == pytest.approx(d.fraction / d.line)
                assert colour["text"][i][j] == f"{d.fraction:.0%}"  # the label: of capacity
                verdict = "<b>fits</b>" if result.fits else "<b>does not fit</b>"
                for part in (
                    verdict,
                    f"binding device: {d.device}",
                    f"peak: {size(d.total)} during {d.peak_phase}",
                    f"headroom: {size(d.line_bytes - d.total)}",
                ):
                    assert part in hover, (part, hover)
    # the current point: framed and named in the whole-batch grid (the second subplot), where plan() says it is
    assert (current["xref"], LENGTHS[current["x"]], GENERATIONS[current["y"]]) == ("x2", 768, 8)
    assert [(s["name"], s["xref"]) for s in seen["shapes"]] == [("current", "x2")]
    now = front.cell(768, 8, None)
    assert "does not fit" in hovered and f"peak: {size(now.peak)} during backward" in hovered
    assert "micro-batch whole batch" in hovered and f"headroom: {size(now.headroom)}" in hovered


MEASURED = Path(__file__).resolve().parents[1] / "bench" / "results" / "frontier_h200_2026-11-27" / "default"
QWEN3_24GIB = [
    "model.name_or_path=builtin:qwen3-8b-random", "placement.learner=cuda:0", "placement.gpu_memory_gib=24",
    "generator.backend=synthetic", "generator.max_completion_length=4096", "generator.max_prompt_length=128",
    "grpo.micro_batch_size=1", "grpo.num_generations=2", "grpo.prompts_per_step=1", "model.dtype=bfloat16",
    "model.bnb_4bit_compute_dtype=bfloat16", "lora.r=16", "lora.lora_alpha=32", "grpo.beta=0",
    "placement.host_memory_gib=120", "model.activation_offload=true",
]  # fmt: skip


def test_the_frontier_marks_the_measured_edge_beside_the_planned_one(tmp_path, capsys):
    """The H200's default-allocator records (offload on: 64K ran, 128K ran out of memory) on the plan's grid."""
    from grpo_lab.cli import main

    argv = ["plan", "tiny-cpu", *[a for s in QWEN3_24GIB for a in ("--set", s)], "--frontier", "--lengths",
            "4096:131072", "--generations", "2", "--micro-batches", "1", "--out", str(tmp_path / "f.html"),
            "--measured", str(MEASURED / "frontier.jsonl")]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ok 91% +" in out and "NO 153% !" in out
    assert "G 2, micro-batch 1: planned edge 65536; measured: ran up to 65536, first failure 131072" in out
    page = (tmp_path / "f.html").read_text()
    assert "measured\\u003c\\u002fb\\u003e: out of memory" in page and "first failure 131072" in page  # hover, table
    offload_off = [s.replace("activation_offload=true", "activation_offload=false") for s in QWEN3_24GIB]
    argv = ["plan", "tiny-cpu", *[a for s in offload_off for a in ("--set", s)], "--frontier", "--lengths",
            "4096:131072", "--generations", "2", "--micro-batches", "1", "--out", str(tmp_path / "g.html"),
            "--measured", str(MEASURED / "frontier.jsonl")]  # fmt: skip
    assert main(argv) == 0
    assert "measured (--measured)" not in capsys.readouterr().out  # the records are offload-on's, not this side's


def test_measured_records_that_cannot_be_read_are_refused_in_one_line(tmp_path, capsys):
    from grpo_lab.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    for path, why in ((tmp_path / "none.jsonl", "cannot read"), (bad, "is not JSON lines")):
        argv = ["plan", "tiny-cpu", "--frontier", "--lengths", "64", "--out", str(tmp_path / "x.html"),
                "--measured", str(path)]  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("grpo-lab: error: --measured: ") and why in err and "\n" not in err
        assert not (tmp_path / "x.html").exists()


def test_the_group_size_moves_the_rollout_even_when_a_chunk_holds_the_whole_batch():
    """Issue 68: a generate call holds the rollout's rows (prompts_per_step x num_generations) when they are fewer than
    generator.chunk_size, so the group size is a live axis of the frontier (it planned chunk_size sequences for every G,
    and notebook 04's G rows were identical)."""
    base = load_config(PRESET, ["grpo.prompts_per_step=1", "placement.host_memory_gib=64"])  # chunk_size 16
    rollouts = []
    for g in (2, 4, 8, 16):
        gpu = plan(load_config(base, [f"grpo.num_generations={g}"])).devices["cuda:0"]
        kv = next(i for i in gpu.items if i.what == "generation KV cache")
        assert kv.note.startswith(f"{g} sequences per call"), kv.note
        rollouts.append(gpu.phase_peak("rollout"))
    assert rollouts == sorted(set(rollouts)), rollouts  # each G holds more
    front = frontier(base, lengths=[4096], generations=[8, 16], micro_batches=[1])
    peaks = {c.generations: c.peak for c in front.cells if (c.length, c.micro_batch) == (4096, 1)}
    assert peaks[16] > peaks[8]


def test_a_host_cell_over_the_guards_line_is_red_though_under_its_capacity():
    """The colour breaks where the verdict does: a host peak at 97% of its capacity, past the guard's 95% line, is
    "does not fit" and red (amber was "tight" on a scale broken at the capacity); one at 90% of the line is amber."""
    from grpo_lab.planner.frontier import COLOURS, ZMAX

    base = load_config("tiny-cpu", ["placement.host_memory_gib=64"])
    host = plan(base).devices["host"].total
    for share, colour in [(0.97, "red"), (0.93, "amber")]:
        config = load_config(base, [f"placement.host_memory_gib={host / share / 1024**3:.6f}"])
        length, gens, micro = own = (
            config.generator.max_completion_length,
            config.grpo.num_generations,
            config.grpo.micro_batch_size,
        )
        front = frontier(config, lengths=[length], generations=[gens], micro_batches=[micro])  # one cell: its own
        cell = front.cell(*own)
        assert cell.device == "host" and cell.fraction == pytest.approx(share, abs=1e-4) and cell.line == 0.95
        assert cell.fits is (colour != "red")
        z = front.figure().data[1].z[0][0] / ZMAX  # where the cell's colour sits on the scale
        amber, red = COLOURS[2][0], COLOURS[4][0]  # the scale's breaks: 90% of the line and the line
        assert (amber <= z < red) if colour == "amber" else z >= red, (share, z)
