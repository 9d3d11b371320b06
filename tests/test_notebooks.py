"""Every notebook runs under papermill with its tiny parameters (real papermill, real kernel)."""
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stripped_and_has_a_parameters_cell(notebook):
    nb = nbformat.read(notebook, as_version=4)
    assert sum("parameters" in c.metadata.get("tags", []) for c in nb.cells) == 1
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")


def run_notebook(notebook, out, cwd, parameters):
    import papermill as pm

    pm.execute_notebook(str(notebook), str(out), cwd=str(cwd), parameters=parameters, kernel_name="python3",
                        progress_bar=False)
    nb = nbformat.read(out, as_version=4)
    assert not any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))
    return nb


def printed(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "stream")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
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
    assert "step 0:" in text and "| next: 1 rollout" in text     # the walk's sync ended step 0 by itself
    if where == "elsewhere":
        assert list(cwd.iterdir()) == []   # nothing written into the user's working directory
