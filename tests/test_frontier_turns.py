"""The fit frontier's turns axis (planner/turn_axis.py, `grpo-lab plan --frontier --turns`): one frontier per number of
turns a tool loop may make, each its config at generator.max_tool_calling_iterations = turns - 1 and each cell plan()
of it; bad input is one line, exit 2, nothing written; the CLI prints each frontier and writes one page."""

from __future__ import annotations

import pytest

from grpo_lab.cli import main
from grpo_lab.config.loading import load_config
from grpo_lab.planner import plan


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpo-lab: error: ") and "\n" not in err
    return err


TOOLS = [
    "model.name_or_path=builtin:qwen2-152k",
    "generator.tools=[my_tools:add]",
    "generator.turn_cache=prefill",  # TRL's loop: a later turn prefills the whole conversation again
    "generator.max_prompt_length=1024",
    "grpo.micro_batch_size=1",
    "placement.host_memory_gib=64",
]


def test_the_turns_axis_plans_one_frontier_per_number_of_turns():
    """`--turns 1,2,4`: each frontier is its config at generator.max_tool_calling_iterations = turns - 1; a second
    turn's re-prefill of 3,071 tokens moves the long cell from backward to the rollout (planner/turns.py), a later
    turn plans as the second (any may be the conversation's longest)."""
    from grpo_lab.planner.turn_axis import frontiers_by_turns

    base = load_config("tiny-cpu", TOOLS)
    fronts = frontiers_by_turns(base, lengths=[2048], generations=[4], micro_batches=[1], turns="1,2,4")
    assert [f.turns for f in fronts] == [1, 2, 4]
    cells = {}
    for f in fronts:
        assert f.config.generator.max_tool_calling_iterations == f.turns - 1
        assert f"{f.turns} turns (a tool loop)" in str(f).splitlines()[0]
        cells[f.turns] = cell = f.cell(2048, 4, 1)
        own = plan(load_config(base, [f"generator.max_tool_calling_iterations={f.turns - 1}",
                                      "generator.max_completion_length=2048"])).devices["host"]  # fmt: skip
        assert cell.peak == pytest.approx(own.total) and cell.phase == own.peak_phase
    assert cells[1].phase == "backward" and cells[2].phase == cells[4].phase == "rollout"
    assert cells[2].peak == cells[4].peak > cells[1].peak


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--frontier", "--turns", "1,2"], "--turns: this config calls no tools"),
        (["--set", "generator.tools=[my_tools:add]", "--frontier", "--turns", "0,2"], "--turns: got 0"),
        (["--set", "generator.tools=[my_tools:add]", "--frontier", "--turns", "two"], "--turns: 'two' is not a whole"),
        (["--set", "generator.tools=[my_tools:add]", "--turns", "2"], "--turns: only with --frontier"),
        (["--set", "generator.tools=[my_tools:add]", "--frontier", "--turns", "2", "--measured", "x.jsonl"],
         "--measured: not with --turns"),
    ],
)  # fmt: skip
def test_bad_turns_input_is_one_line_exit_2_and_writes_nothing(args, problem, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert problem in _one_line_error(capsys, ["plan", "tiny-cpu", *args])
    assert list(tmp_path.iterdir()) == []


def test_cli_turns_prints_each_frontier_and_one_page(tmp_path, monkeypatch, capsys):
    from grpo_lab.planner.turn_axis import frontiers_by_turns

    monkeypatch.chdir(tmp_path)
    sets = [a for o in TOOLS for a in ("--set", o)]
    assert (
        main(["plan", "tiny-cpu", *sets, "--frontier", "--lengths", "2048", "--generations", "4", "--turns", "1,2"])
        == 0
    )
    out = capsys.readouterr().out
    fronts = frontiers_by_turns(load_config("tiny-cpu", TOOLS), [2048], [4], None, turns=[1, 2])
    assert out.startswith("\n\n".join(map(str, fronts)) + "\n")
    assert f"frontier page: open {tmp_path / 'frontier.html'} in a browser (one frontier per number of turns)" in out
    page = (tmp_path / "frontier.html").read_text()
    assert page.count("<h2>") == 2 and "<h2>2 turns</h2>" in page and page.count("plotly.js v") <= 2
