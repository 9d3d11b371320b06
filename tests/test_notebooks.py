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


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_under_papermill(notebook, tiny_model, tmp_path):
    import papermill as pm

    pm.execute_notebook(str(notebook), str(tmp_path / notebook.name), cwd=str(notebook.parent),
                        parameters={"model_path": tiny_model, "steps": 1}, kernel_name="python3",
                        progress_bar=False)
    out = nbformat.read(tmp_path / notebook.name, as_version=4)
    assert not any(o.get("output_type") == "error" for c in out.cells for o in c.get("outputs", []))
