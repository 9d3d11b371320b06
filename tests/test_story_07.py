"""Notebook 07's story, executed under papermill with its defaults: `builtin:tiny-tools` calls a calculator whose
answers grow (its tape, data/tape.py); a first step, its tape short, runs under the host budget; a later one, its
tape grown, crosses the line at the turn after the calls; the live guard stops the rollout there, in one line naming
the turn and the knobs, and the step is undone; each turn's measured peak is printed beside the plan; the tool-result
bound runs the same step again (its tools called again) under the same line."""

import pytest
from test_notebook_stories import NOTEBOOKS, check_crossing, check_prose, check_static_figures
from test_notebooks import ROOT, printed, run_notebook

from grpo_lab.ui.story import facts_in

NAME = "07_agent_turns.ipynb"
KNOBS = [  # the rows in flight, the turns, the tool-result bound, the trajectory budget
    "generator.chunk_size",
    "generator.max_tool_calling_iterations",
    "generator.max_tool_response_tokens",
    "generator.max_completion_length",
]
MARKS = ["turn 1", "tools 1", "turn 2"]
# the plan of a turn as it ran over its measured peak (host RSS, the sampler's): the plan's promise, 0.9-1.1 (CPU,
# builtin:tiny-tools; its prefill's activations: planner/turns.py prefill_bytes)
RAN_BAND = (0.9, 1.1)


@pytest.mark.slow
def test_07_the_turn_after_grown_answers_crosses_the_line_and_the_bound_runs_under_it(user_cache, tmp_path):
    nb = run_notebook(NOTEBOOKS / NAME, tmp_path / NAME, ROOT, {})
    facts = facts_in(nb)
    check_crossing(facts)  # stopped as it crossed, quoting its peak; the fix under the same line
    first, failing, fixed = facts["first"], facts["failing"], facts["fixed"]
    assert first["stopped"] is None and not first["crossed"] and first["line_mib"] == failing["line_mib"]
    # stopped in the rollout at the turn after the calls, named in its one line with the knobs that lower it
    stopped = failing["stopped"]
    assert failing["phase"] == "rollout" and facts["stopped_at"] == "turn 2"
    assert "during phase 'rollout' of step 1, at turn 2, no update had been applied" in stopped
    assert all(knob in stopped for knob in KNOBS), stopped
    # each turn's peak: the undone attempt's turns in order, turn 2 over the line and above turn 1; the fix's turns
    # (a new attempt: the tools called again) all under it; the plan beside each
    undone = facts["failing_turns"]
    assert [p["mark"] for p in undone] == MARKS and all(p["undone"] for p in undone), undone
    peak = {p["mark"]: p["peak_mib"] for p in undone}
    assert peak["turn 2"] > failing["line_mib"] and peak["turn 2"] > peak["turn 1"], peak
    kept = facts["fixed_turns"]
    assert [p["mark"] for p in kept] == MARKS and not any(p["undone"] for p in kept), kept
    assert all(p["peak_mib"] < fixed["line_mib"] for p in kept) and all(p["planned_mib"] for p in kept + undone), kept
    assert facts["fix_called_again"] is True and fixed["plan_ratio"] is not None
    # the plan of each turn as it ran (its recorded shapes): beside each kept turn, near its measured peak; none
    # beside a round of tools, nor beside the turn the guard stopped (its generate() call never ended)
    ran = {p["mark"]: p["ran_mib"] and p["ran_mib"] / p["peak_mib"] for p in kept}
    assert ran["tools 1"] is None and all(RAN_BAND[0] <= ran[m] <= RAN_BAND[1] for m in ("turn 1", "turn 2")), ran
    assert undone[0]["ran_mib"] and undone[2]["ran_mib"] is None, undone
    # the undone attempt's turn 1, before the notebook's first figure (the kernel holds no figure library yet: the
    # plan's kernel lines, planner/kernel_share.py), within the same band
    assert RAN_BAND[0] <= undone[0]["ran_mib"] / undone[0]["peak_mib"] <= RAN_BAND[1], undone
    text = printed(nb)
    assert "planned (worst)" in text and "planned (as run)" in text
    assert "plan/measured" in text and "stopped at turn 2; the step to run: 1, its next phase: rollout" in text
    check_prose(NAME, nb, facts)
    check_static_figures(nb)
    figures = [o["data"] for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(figures) >= 2  # the timeline with the turn marks, at the stop and after the fix
