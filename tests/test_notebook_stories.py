"""The guided notebooks' stories (issue 42), executed under papermill with their own defaults: each shows its
failure crossing a memory budget with the failing setting, then the fix under it; every number its prose quotes is a
fact a cell computes (tested by name); every figure is in the saved outputs as an image; and a parameter the notebook
cannot use stops at the cell after the parameters, in one line."""

import re
from pathlib import Path

import nbformat
import pytest
from test_notebooks import ROOT, run_notebook

from grpo_lab.ui.story import facts_in

NOTEBOOKS = ROOT / "notebooks"

# notebook -> [(fact path, how the prose writes it)]: the only numbers its markdown may hold
PROSE = {
    "02_placement_dataparallel.ipynb": [
        ("spill_gib.cuda:1.unwrapped", "vLLM's share, {}"),
        ("spill_gib.cuda:1.capacity", "of {} GiB. Wrapped"),
        ("spill_gib.cuda:1.wrapped", "each batch: {} GiB"),
        ("spill_gib.cuda:1.capacity", "on a card of {}."),
    ],
    "03_chunked_generation.ipynb": [
        ("sequences", "all {} sequences"),
        ("planned_kv_mib.None", "at {:,} MiB"),
        ("planned_kv_mib.16", "one chunk of 16 at {:,} MiB"),
        ("host_budget_gib", "a budget of\n{} GiB"),
    ],
    "04_logprob_memory.ipynb": [
        ("planned_head_mib.full", "textbook head at {:,} MiB"),
        ("planned_head_mib.chunked", "chunked one at {:,} MiB"),
        ("host_budget_gib", "a budget of {} GiB"),
    ],
    "05_reference_and_offload.ipynb": [
        ("offload_gpu_saved_gib", "offload takes {:.2f} GiB off the GPU"),
        ("offload_host_added_gib", "puts {:.2f} GiB on the host"),
        ("copy_cost_gib", "the copy adds {:.2f} GiB"),
    ],
    "06_sharded_learner.ipynb": [],
    "07_agent_turns.ipynb": [("stopped_at", "stopped at {}")],
}
# what a number in prose may also be: a chunk size the text names as a setting, not a measurement
SETTING_NUMBERS = {"03_chunked_generation.ipynb": {"16"}}


def fact(facts: dict, path: str):
    value = facts
    for key in path.split("."):
        value = value[key]
    return value


def derived(facts: dict) -> dict:
    """Facts the prose quotes as a difference of two computed ones."""
    out = dict(facts)
    offload = facts.get("offload_plan")
    if offload:
        out["offload_gpu_saved_gib"] = offload["false"]["gpu_gib"] - offload["true"]["gpu_gib"]
        out["offload_host_added_gib"] = offload["true"]["host_gib"] - offload["false"]["host_gib"]
    return out


def prose(nb) -> str:
    return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


def bare_numbers(text: str) -> list[str]:
    """Numbers standing alone in prose: not in code, not a heading's section number, not a notebook's, rank's or
    step's name, not part of a name (P2, FSDP2, nf4, 4-bit, ZeRO-3, cuda:1)."""
    text = re.sub(r"```.*?```|`[^`]*`", "", text, flags=re.S)  # code
    text = re.sub(r"(?i:notebook|rank|step) \d+", "", text)  # names: another notebook, a rank, a step
    text = re.sub(r"(?m)^#+ .*$", lambda m: re.sub(r"\b\d+ ·", "", m.group(0)), text)  # "## P4 · 1 · The failure"
    return re.findall(r"(?<![\w.:\-/\[])\d[\d,]*(?:\.\d+)?(?![\w\-/%])", text)


def check_prose(name: str, nb, facts: dict) -> None:
    text, facts = prose(nb), derived(facts)
    quoted = []
    for path, form in PROSE[name]:
        expected = form.format(fact(facts, path))
        assert expected in text, f"{name}: the prose should read {expected!r} (fact {path})"
        quoted.append(expected)
    for expected in quoted:
        text = text.replace(expected, "")
    stray = [n for n in bare_numbers(text) if n not in SETTING_NUMBERS.get(name, set())]
    assert not stray, f"{name}: numbers in prose that no fact backs: {stray}"


def check_static_figures(nb) -> None:
    """Each figure is saved once, as a PNG (a headless run: no plotly JSON beside it); every live plot (a widget) is
    followed by a PNG of its timeline."""
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    for i, o in enumerate(outputs):
        data = o.get("data", {})
        assert "application/vnd.plotly.v1+json" not in data, f"a figure saved twice: {data.get('text/plain', '')[:80]}"
        if "application/vnd.jupyter.widget-view+json" in data and "FigureWidget" in data.get("text/plain", ""):
            later = outputs[i + 1 :]
            assert any("image/png" in p.get("data", {}) for p in later), "a live plot with no image after it"


def check_crossing(facts: dict) -> None:
    """The failing setting crosses the line, and the guard stops the phase that crossed it, quoting the phase's peak,
    the figure the trial reads; the fix runs the same step under the same line."""
    failing, fixed = facts["failing"], facts["fixed"]
    assert failing["stopped"] and "\n" not in failing["stopped"] and "placement.host_memory_gib" in failing["stopped"]
    if "host RAM would reach" in failing["stopped"]:  # refused before one native call past the line (algo/room.py)
        quoted = (
            float(failing["stopped"].split("would reach ")[1].split("%")[0]) / 100 * facts["host_budget_gib"] * 1024
        )
        assert failing["crossed"] and quoted > failing["line_mib"] >= failing["peak_mib"], failing
        assert fixed["line_mib"] == failing["line_mib"] and not fixed["crossed"] and fixed["stopped"] is None, fixed
        return
    assert failing["crossed"] and failing["peak_mib"] > failing["line_mib"], failing
    assert f"during phase '{failing['phase']}'" in failing["stopped"], failing
    quoted = float(failing["stopped"].split("reached ")[1].split("%")[0]) / 100 * facts["host_budget_gib"] * 1024
    assert quoted == pytest.approx(failing["peak_mib"], rel=2e-3)  # one figure: the guard's is the trial's
    assert not fixed["crossed"] and fixed["peak_mib"] < fixed["line_mib"] and fixed["stopped"] is None, fixed
    assert fixed["line_mib"] == failing["line_mib"]  # the same budget


def check_kernel_limit(facts: dict) -> None:
    """A story told on a kernel-enforced limit (placement.host_limit: cgroup) where this machine can make one: the
    guard stopped the failing step at its line, within 5 % of the limit past it and not seconds above it, and the
    process lived to run the fix under the same limit."""
    from grpo_lab.memory.kernel_limit import unavailable

    failing, budget_mib = facts["failing"], facts["host_budget_gib"] * 1024
    assert failing["peak_mib"] - failing["line_mib"] <= 0.05 * budget_mib, failing
    assert failing["over_line_s"] < 0.5, failing  # memory stops at the line
    if unavailable() is None:
        assert "the kernel's limit on this process" in failing["stopped"], failing["stopped"]


def run_story(name: str, tmp_path: Path):
    # (run_notebook checks what it saved: at most 1 MB, no library notice on stderr, no frozen bar: check_saved)
    nb = run_notebook(NOTEBOOKS / name, tmp_path / name, ROOT, {"steps": 1})
    facts = facts_in(nb)
    check_crossing(facts)
    check_prose(name, nb, facts)
    check_static_figures(nb)
    assert "GPU cells skipped:" in "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    return facts


# why alone (pytest.mark.solo, pytest.mark.alone): it crosses a kernel-enforced limit, and the live guard's stop
# before the kernel's kill needs its sampler thread on a core; a busy neighbour can starve it past the line
@pytest.mark.slow
@pytest.mark.solo
@pytest.mark.alone
def test_03_a_whole_batch_rollout_crosses_the_budget_and_chunks_fit(tiny_model, tmp_path):
    facts = run_story("03_chunked_generation.ipynb", tmp_path)
    assert facts["failing"]["phase"] == "rollout"  # the KV cache is the failing step's peak, stopped as it crosses
    check_kernel_limit(facts)
    fixed = facts["fixed"]  # the retry runs the undone rollout again, in chunks, under the line
    assert fixed["generate_calls"] == facts["sequences"] // 16 > 1, fixed
    assert fixed["phase_peaks_mib"]["rollout"] < fixed["line_mib"], fixed
    assert facts["planned_kv_mib"]["None"] == 4 * facts["planned_kv_mib"]["16"]  # 64 sequences against chunks of 16
    assert facts["real_over"] == ["None@8192"]  # the real model: only the unchunked longest rollout is over its card


@pytest.mark.slow
def test_04_the_textbook_head_crosses_the_budget_and_the_chunked_head_fits(tiny_model, tmp_path):
    facts = run_story("04_logprob_memory.ipynb", tmp_path)
    assert facts["failing"]["phase"] == "backward"  # failed as it ends: no update was applied
    assert facts["planned_head_mib"]["full"] > 20 * facts["planned_head_mib"]["chunked"]
    # micro-batches: one gradient whatever the split (a broken accumulation changes the norm), and a real update
    norms = list(facts["grad_norms"].values())
    assert min(norms) > 0 and max(norms) - min(norms) <= 1e-5 * max(norms), norms
    assert facts["update_moved"] > 0
    # the plan's own fixes name the head it then applies; the real model's plan is said as it is: the textbook head
    # fits the card at the config's lengths, and the chunked head fits more of the frontier
    assert facts["planned_fixes"][0] == "grpo.logprob_head: chunked", facts["planned_fixes"]
    assert facts["real_full_fits"] is True
    fit = facts["frontier_cells_that_fit"]
    assert fit["chunked"] > fit["full"] > 0, fit


# why alone (pytest.mark.solo, pytest.mark.alone): it crosses a kernel-enforced limit, and the live guard's stop
# before the kernel's kill needs its sampler thread on a core; a busy neighbour can starve it past the line
@pytest.mark.slow
@pytest.mark.solo
@pytest.mark.alone
def test_05_the_host_crosses_its_line_is_rolled_back_and_micro_batches_fit(tiny_model, tmp_path):
    facts = run_story("05_reference_and_offload.ipynb", tmp_path)
    assert facts["failing"]["phase"] == "backward"
    failing = facts["failing"]  # the live guard stops the backward at the line: planned over it, stopped just past it
    assert facts["planned_backward_mib"] > failing["line_mib"], facts["planned_backward_mib"]
    assert 0 < facts["stopped_past_line_mib"] <= 0.05 * facts["host_budget_gib"] * 1024, facts["stopped_past_line_mib"]
    check_kernel_limit(facts)
    # the fix run is the plan's own: the micro-batch its last line names, and the plan of that step against its run
    assert f"grpo.micro_batch_size: {facts['fixed']['label'].split(': ')[1]}" in facts["planned_fixes"]
    assert 0.9 <= facts["plan_ratio"] <= 1.1, facts["plan_ratio"]
    checkpointed = facts["checkpointed"]  # the second fix, a new Lab with checkpointing: the same line, under it
    assert not checkpointed["crossed"] and checkpointed["stopped"] is None, checkpointed
    assert checkpointed["line_mib"] == facts["failing"]["line_mib"]
    assert checkpointed["phase_peaks_mib"]["backward"] < facts["failing"]["peak_mib"]
    measured = facts["reference_measured"]  # P5: both strategies loaded and run here, not only planned
    assert set(measured) == {"copy", "adapter-disabled"} and all(m["logprobs_rise_mib"] > 0 for m in measured.values())
    assert measured["copy"]["weights_mib"] > 0 == measured["adapter-disabled"]["weights_mib"]
    assert measured["copy"]["planned_mib"] > measured["adapter-disabled"]["planned_mib"]
    assert facts["rolled_back"] == {"lora": True, "adamw": True, "step_unchanged": True}
    assert facts["reference_max_abs_diff"] <= 1e-5  # P5: the copy scores as the adapter-disabled policy at step 0
    assert (
        facts["copy_cost_gib"] > 1
        and facts["offload_plan"]["true"]["host_gib"] > facts["offload_plan"]["false"]["host_gib"]
    )


@pytest.mark.parametrize(
    "value, says",
    [("no-such-preset", "is neither a YAML file nor a preset"), ("qwen2.5-7b-nf4-24gb", "has no CUDA device")],
    ids=["unknown-preset", "gpu-config-on-cpu"],
)
def test_a_parameter_the_notebook_cannot_use_stops_after_the_parameters_in_one_line(value, says, tmp_path):
    import papermill as pm

    out = tmp_path / "out.ipynb"
    with pytest.raises(pm.PapermillExecutionError) as caught:
        pm.execute_notebook(
            str(NOTEBOOKS / "04_logprob_memory.ipynb"),
            str(out),
            cwd=str(ROOT),
            parameters={"config": value},
            kernel_name="python3",
            progress_bar=False,
        )
    assert caught.value.evalue.startswith("parameter config: ") and says in caught.value.evalue
    assert "\n" not in caught.value.evalue
    nb = nbformat.read(out, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    tags = [c.metadata.get("tags", []) for c in code]
    failed = [i for i, c in enumerate(code) if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    assert failed == [tags.index(["injected-parameters"]) + 1]  # the first cell after the parameters, nothing later
    error = next(o for o in code[failed[0]].outputs if o.output_type == "error")
    assert len(error["traceback"]) == 1  # the one line, not a traceback


def test_the_prose_check_catches_a_stray_and_a_wrong_number():
    """The checker itself: a number no fact backs, and a quoted number that disagrees with its fact, both fail."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell(
            "# 04 · P2 and FSDP2\nThe textbook head at 1,782 MiB and the chunked "
            "one at 75 MiB, against a budget of 2.0 GiB; `x = 7`."
        )
    ]
    facts = {"planned_head_mib": {"full": 1782, "chunked": 75}, "host_budget_gib": 2.0}
    check_prose("04_logprob_memory.ipynb", nb, facts)
    with pytest.raises(AssertionError, match="textbook head at 1,783 MiB"):
        check_prose("04_logprob_memory.ipynb", nb, {**facts, "planned_head_mib": {"full": 1783, "chunked": 75}})
    nb.cells[0].source += " It took 12 s."
    with pytest.raises(AssertionError, match=r"\['12'\]"):
        check_prose("04_logprob_memory.ipynb", nb, facts)


@pytest.mark.slow
def test_02_a_16_bit_learner_spills_when_wrapped_and_the_guard_and_bridge_stop_it(tiny_model, tmp_path):
    """P1 as today's transformers has it: Trainer wraps a 16-bit model, not a 4-bit one (measured, not asserted from
    docs); the plan puts the wrapped 16-bit learner over the generator's GPU and the unwrapped one under it; the guard
    refuses a wrapped learner in one line and the unwrapped step runs; TRL inside the bridge stays unwrapped."""
    name = "02_placement_dataparallel.ipynb"
    nb = run_notebook(NOTEBOOKS / name, tmp_path / name, ROOT, {"steps": 1})
    facts = facts_in(nb)
    assert facts["wrapped"]["16-bit"] == "DataParallel" and facts["wrapped"]["4-bit"] != "DataParallel"
    gen = facts["spill_gib"]["cuda:1"]
    assert gen["wrapped"] > gen["capacity"] >= gen["unwrapped"] and facts["spill_fits_unwrapped"] is True
    assert "DataParallel" in facts["refused"] and "\n" not in facts["refused"]
    assert facts["step_after_unwrap"] == 0 and facts["bridged"] != "DataParallel"
    check_prose(name, nb, facts)
    check_static_figures(nb)
