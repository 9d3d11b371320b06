"""What the plan, the memory table and a step result look like in a notebook cell and in a terminal (issue 72): HTML
tables whose notes wrap in their own column (nothing scrolls sideways in an 848 px output), and text at 120 columns
that wraps only at word boundaries."""

from types import SimpleNamespace

import pytest

from grpo_lab.config.loading import load_config
from grpo_lab.memory.tables import TEXT_WIDTH, Column, MemoryTable, Table
from grpo_lab.planner import plan
from grpo_lab.planner.render import render

PLANS = [
    ("tiny-cpu", []),
    ("qwen2.5-7b-nf4-24gb", []),
    ("qwen2.5-7b-nf4-24gb", ["placement.generator=cuda:1", "generator.backend=vllm"]),  # the what-if and the split
    ("p1-qwq32b-nf4-2xa100-40gb", []),
]


@pytest.mark.parametrize("preset, overrides", PLANS)
def test_the_plans_text_fits_120_columns_and_wraps_only_between_words(preset, overrides):
    """`print(lab.plan())` wrapped mid-word ('refere/nce', '1./10x') at 384 characters a line."""
    result = plan(load_config(preset, overrides))
    text, unwrapped = render(result), render(result, width=10**6)
    assert max(map(len, text.splitlines())) <= TEXT_WIDTH, text
    assert text.split() == unwrapped.split()  # the same words in the same order: none was cut
    assert str(result) == text and repr(result) == text  # a cell's plain text, and print()'s, are the same
    assert max(map(len, unwrapped.splitlines())) > TEXT_WIDTH  # (else this test proves nothing)


def test_the_plan_in_a_cell_is_one_table_per_device_with_its_notes_in_their_own_column():
    result = plan(load_config("qwen2.5-7b-nf4-24gb", ["placement.generator=cuda:1", "generator.backend=vllm"]))
    page = result._repr_html_()
    assert page.count("<table") == len(result.devices) and "white-space:pre;" not in page
    assert page.count("white-space:normal") >= len(result.devices)  # every table's notes column wraps
    assert "max-width:100%" in page and "text-align:right" in page  # fits the output; numbers aligned
    for d in result.devices.values():
        assert all(item.what in page for item in d.items)
    assert "verdict: fits" in page


def test_a_tables_long_note_wraps_inside_its_column_and_numbers_align_right():
    note = "a long note " * 20
    table = Table([Column("what"), Column("MiB", numeric=True), Column("note", wraps=True)], [["a", "1.0", note]])
    table.rows.append(["longer item", "1,234.5", "short"])
    lines = table.text(width=60).splitlines()
    assert max(map(len, lines)) <= 60 and " ".join(" ".join(lines[1:-1]).split()[2:]) == note.strip()
    column = lines[1].index("a long")
    assert all(line[:column].strip() == "" for line in lines[2:-1])  # continuation lines stay in the note column
    assert lines[1].index("1.0") + 3 == lines[-1].index("1,234.5") + 7  # right-aligned


def rows():
    MiB = 2**20
    row = dict(phase="rollout", device="host", metric="rss", start=500 * MiB, peak=612.34 * MiB, end=510 * MiB)
    return [dict(row, delta=10 * MiB), dict(row, phase="backward", delta=-2 * MiB)]


def test_the_memory_table_prints_as_before_and_shows_as_a_table_in_a_cell():
    """On its own line in a cell, lab.memory_table() was a quoted string of literal \\n's."""
    from IPython.core.formatters import DisplayFormatter

    from grpo_lab.memory import format_table

    table = MemoryTable(rows(), step=3)
    assert isinstance(table, str) and str(table) == format_table(rows()) and "rollout" in table
    data, _ = DisplayFormatter().format(table)
    assert data["text/plain"] == format_table(rows())  # unquoted, its own lines
    page = data["text/html"]
    assert page.count("<tr>") == 3 and "step 3: memory per phase (MiB)" in page and "612.3" in page and "-2.0" in page


def test_a_step_result_in_a_cell_is_a_table_with_its_memory_folded(loaded_lab):
    from IPython.core.formatters import DisplayFormatter

    from grpo_lab.ui.reprs import step_results_as_tables

    lab = loaded_lab()
    try:
        result = lab.step()
        formatter = DisplayFormatter()
        assert step_results_as_tables(SimpleNamespace(display_formatter=formatter))
        data, _ = formatter.format(result)
        page, text = data["text/html"], data["text/plain"]
        assert "<details>" in page and page.count("<table") == 2 and f"{result.loss:+.4f}" in page
        assert f"memory per phase ({len(result.memory)} rows" in page
        result.rewards = {f"reward_function_{k}": 0.5 for k in range(6)}  # each named: a line past 120 columns
        text = formatter.format(result)[0]["text/plain"]
        assert len(repr(result)) > TEXT_WIDTH and "reward_function_5" in formatter.format(result)[0]["text/html"]
        assert max(map(len, text.splitlines())) <= TEXT_WIDTH and text.split() == repr(result).split()
        assert "<tr>" in lab.memory_table()._repr_html_()
    finally:
        lab.close()
