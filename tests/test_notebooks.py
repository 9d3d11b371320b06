"""Every notebook runs under papermill with its tiny parameters (real papermill, real kernel)."""

import json
import os
import re
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
# run once, by their own tests: 02-05 in test_notebook_stories.py, 06 in test_story_06.py (three sharded Labs, ~2 min),
# 07 in test_story_07.py
OWN_TEST = {
    "02_placement_dataparallel.ipynb",
    "03_chunked_generation.ipynb",
    "04_logprob_memory.ipynb",
    "05_reference_and_offload.ipynb",
    "06_sharded_learner.ipynb",
    "07_agent_turns.ipynb",
}


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stripped_and_has_a_parameters_cell(notebook):
    nb = nbformat.read(notebook, as_version=4)
    assert sum("parameters" in c.metadata.get("tags", []) for c in nb.cells) == 1
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")


# each papermill run's wall time, one line per run (the notebooks' 5-minute budget: docs/notebooks.md)
TIMES = Path(os.environ.get("GRPO_LAB_ARTIFACTS", ROOT / ".artifacts")) / "notebook_times.tsv"


def run_notebook(notebook, out, cwd, parameters):
    import papermill as pm

    from grpo_lab.sweep import IOPUB_TIMEOUT_S

    started = time.perf_counter()
    pm.execute_notebook(  # why the iopub timeout: as a sweep runs them (papermill's 4 s fails on a busy machine)
        str(notebook),
        str(out),
        cwd=str(cwd),
        parameters=parameters,
        kernel_name="python3",
        progress_bar=False,
        iopub_timeout=IOPUB_TIMEOUT_S,
    )
    TIMES.parent.mkdir(parents=True, exist_ok=True)
    with TIMES.open("a") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')}\t{Path(notebook).name}\t{time.perf_counter() - started:.0f}\n")
    nb = nbformat.read(out, as_version=4)
    assert not any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))
    check_saved(Path(notebook).name, Path(out), nb)
    return nb


MAX_SAVED_BYTES = 1_000_000  # issue 51: papermill saved 5.4-11.7 MB, plotly's widget bundle once per live plot
MAX_TEXT_PLAIN = 4096  # a line or a table; a FigureWidget's text/plain was its whole figure, 13-28 KB


def check_saved(name: str, path: Path, nb) -> None:
    """What a papermill run of notebook `name` saved at `path` (each run_notebook checks its own, so 01-06 are checked
    without running any twice): at most 1 MB, no output whose text/plain is over 4 KB, and no cell ending in a bare
    value that shows only as text (a float, a dict: a library call's return value the cell did not mean to show)."""
    size, widgets = path.stat().st_size, len(json.dumps(nb.metadata.get("widgets", {})))
    assert size <= MAX_SAVED_BYTES, f"{name}: {size:,} bytes saved, {widgets:,} of them widget state"
    outputs = [(c, o) for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") != "stream"]
    long = [(c.source.splitlines()[0], text_plain(o)) for c, o in outputs if text_plain(o) > MAX_TEXT_PLAIN]
    assert not long, f"{name}: text/plain over {MAX_TEXT_PLAIN:,} characters: {long}"
    assert not stray_values(nb), f"{name}: cells that show a bare value: {stray_values(nb)}"
    noisy = noise(nb)
    assert not noisy, f"{name}: library noise in the saved outputs: {noisy}"


# what a saved notebook may not show: a library's warning or notice on stderr, a progress bar (saved frozen, "0%"),
# a float printed to 17 digits, a dict of more than a line printed raw
NOISE = {
    "stderr": lambda o: o.get("name") == "stderr" and o.get("text", "").strip(),
    "progress bar": lambda o: re.search(r"\d+%\|", o.get("text", "") + o.get("data", {}).get("text/plain", "")),
    "long float": lambda o: re.search(r"\d\.\d{9,}", o.get("text", "") + o.get("data", {}).get("text/plain", "")),
    "raw dict": lambda o: re.search(r"\{'[^{}]{200,}\}", o.get("text", "")),
    # Ray's driver prints the raylet's messages (a rank's death: a paragraph) on stdout, not stderr
    "Ray's raylet": lambda o: "(raylet)" in o.get("text", ""),
}


def noise(nb) -> list[tuple[str, str]]:
    """(what, the output's first 120 characters) of each output a reader should not have to read past."""
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    return [
        (what, (o.get("text", "") or o.get("data", {}).get("text/plain", ""))[:120])
        for o in outputs
        for what, found in NOISE.items()
        if found(o)
    ]


def text_plain(output) -> int:
    return len(output.get("data", {}).get("text/plain", ""))


def stray_values(nb) -> list[tuple[str, str]]:
    """(last line, what it shows) of each cell whose result is a value with nothing but a text form."""
    return [
        (last, o["data"]["text/plain"][:80])
        for c in nb.cells
        for last in c.source.strip().splitlines()[-1:]
        for o in c.get("outputs", [])
        if o.get("output_type") == "execute_result" and set(o["data"]) == {"text/plain"}
    ]


def printed(nb) -> str:
    return "".join(
        o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "stream"
    )


@pytest.mark.parametrize("notebook", [nb for nb in NOTEBOOKS if nb.name not in OWN_TEST], ids=lambda p: p.name)
def test_notebook_runs_under_papermill_from_the_repo_root(notebook, tiny_model, tmp_path):
    """With its own defaults (preset names, the built-in tiny model), from the repo root."""
    run_notebook(notebook, tmp_path / notebook.name, ROOT, {"steps": 1})


@pytest.mark.parametrize("where", ["notebooks", "elsewhere"])
def test_quickstart_runs_from_any_working_directory(where, tiny_model, tmp_path):
    cwd = ROOT / "notebooks" if where == "notebooks" else tmp_path / "unrelated"
    cwd.mkdir(exist_ok=True)
    nb = run_notebook(ROOT / "notebooks" / "01_quickstart.ipynb", tmp_path / "out.ipynb", cwd, {"steps": 1})
    text = printed(nb)
    # the knob cell's edits did what its comments say: 8 sequences in calls of 4, the new lr and temperature
    assert "generate calls 2, learning rate 0.0003, temperature 0.7" in text, text[-2000:]
    assert "refused: lora.r: fixed when the Lab loads" in text
    assert "step 0:" in text and "| next: 1 rollout" in text  # the walk's sync ended step 0 by itself
    # the built-in model's completion reads as a worked answer (random weights printed ' 6\x7f\ufffdui\ufffdFay')
    assert re.search(r"'\d+ [-+*] \d+ = -?\d+\. <answer>", text), text[:3000]
    if where == "elsewhere":
        assert list(cwd.iterdir()) == []  # nothing written into the user's working directory
    from test_notebook_stories import bare_numbers, check_static_figures, prose

    check_static_figures(nb)  # the live plot and the panel, each followed by an image a saved notebook keeps
    assert not bare_numbers(prose(nb)), bare_numbers(prose(nb))  # no number in its prose that no cell computes


def test_the_saved_notebook_check_catches_bloat_long_text_and_a_bare_value(tmp_path):
    """The checker itself, on notebooks written here: a bare float a cell shows, a 20 KB text/plain and 2 MB of widget
    state each fail; a Lab's summary (it has an HTML form) passes."""
    new = nbformat.v4

    def saved(*outputs, name="01_quickstart.ipynb", source="lab.optimizer()", widgets=None):
        nb = new.new_notebook(cells=[new.new_code_cell(source, outputs=list(outputs))])
        if widgets:
            nb.metadata["widgets"] = widgets
        path = tmp_path / name
        nbformat.write(nb, path)
        return name, path, nbformat.read(path, as_version=4)

    check_saved(*saved(new.new_output("execute_result", {"text/plain": "<Lab ...>", "text/html": "<b>Lab</b>"})))
    bare = new.new_output("execute_result", {"text/plain": "7.28e-08"}, execution_count=1)
    with pytest.raises(AssertionError, match="bare value: \\[\\('lab.optimizer\\(\\)', '7.28e-08'\\)\\]"):
        check_saved(*saved(bare))
    with pytest.raises(AssertionError, match="text/plain over 4,096 characters"):
        check_saved(*saved(new.new_output("display_data", {"text/plain": "FigureWidget({" + "x" * 20_000})))
    with pytest.raises(AssertionError, match="of them widget state"):
        check_saved(*saved(widgets={"application/vnd.jupyter.widget-state+json": {"state": {"m": "x" * 2_000_000}}}))


@pytest.mark.parametrize(
    "output, what",
    [
        (
            nbformat.v4.new_output(
                "stream", name="stderr", text="Triton is installed, but doesn't include CPU backend."
            ),
            "stderr",
        ),
        (
            nbformat.v4.new_output("display_data", {"text/plain": "Loading weights:   0%|          | 0/38"}),
            "progress bar",
        ),
        (nbformat.v4.new_output("stream", name="stdout", text="ratio 0.97823410982734561\n"), "long float"),
        (
            nbformat.v4.new_output("stream", name="stdout", text=str({f"metric_{i}": "0.5" for i in range(12)})),
            "raw dict",
        ),
    ],
    ids=["stderr", "progress-bar", "long-float", "raw-dict"],
)
def test_the_saved_notebook_check_catches_library_noise(output, what, tmp_path):
    """A library's notice, a frozen bar, a 17-digit float and a printed metrics dict each fail a saved notebook; a
    short table and a rounded ratio pass."""
    new = nbformat.v4
    clean = new.new_output("stream", name="stdout", text="backward: planned 1,204 MiB, measured 1,180 MiB (1.02)\n")
    nb = new.new_notebook(cells=[new.new_code_cell("lab.step()", outputs=[clean])])
    path = tmp_path / "01_quickstart.ipynb"
    nbformat.write(nb, path)
    check_saved(path.name, path, nbformat.read(path, as_version=4))
    nb.cells[0].outputs.append(output)
    nbformat.write(nb, path)
    with pytest.raises(AssertionError, match=f"library noise in the saved outputs: \\[\\('{what}'"):
        check_saved(path.name, path, nbformat.read(path, as_version=4))
