"""Papermill sweeps: run a notebook once per grid point and collect, per run, the last step's
metrics and the peak memory per device into DIR/summary.csv and a DIR/summary.html plot, which links to
DIR/compare.html (comparison.py: the points' per-phase peaks and reward/loss curves side by side).

A sweepable notebook has a cell tagged `parameters` that includes `results_path`, and ends
with `lab.save_results(results_path)` when it is set. A grid point that fails (out of memory
included, or its kernel killed) is a row with its error, and the sweep goes on: that is data too.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import re
from pathlib import Path
from typing import Optional, Union

import yaml

from .checks.paths import check_output_dir
from .comparison import RunRecord, compare
from .errors import LabError
from .memory.readers import MiB, is_host

IOPUB_TIMEOUT_S = 300  # the longest a point's output may lag its cell's reply


def notebook_parameters(notebook: Path) -> dict:
    from .checks.paths import read_notebook

    nb = read_notebook(notebook, "sweep NOTEBOOK")
    if not any("parameters" in c.metadata.get("tags", []) for c in nb.cells):
        raise LabError(f"sweep: {notebook.name} has no cell tagged 'parameters'; tag the cell that sets its defaults")
    import papermill as pm

    try:
        return pm.inspect_notebook(str(notebook))
    except ValueError as err:  # why: papermill's ValueError, e.g. a notebook without kernel metadata
        raise LabError(
            f"sweep NOTEBOOK: papermill cannot read the parameters of {notebook.name} ({err}); "
            "open and save it in Jupyter to repair it"
        ) from None


def parse_grid(items: list[str]) -> dict[str, list]:
    """['key=v1,v2', ...] -> {'key': [v1, v2]} with each value parsed as YAML."""
    grid: dict[str, list] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key.strip() or not values.strip():
            raise LabError(f"--grid {item!r}: expected KEY=V1,V2,..., e.g. micro_batch_size=2,4")
        grid[key.strip()] = [yaml.safe_load(v) for v in values.split(",")]
    return grid


def point_name(stem: str, point: dict) -> str:
    text = "__".join(f"{k}={v}" for k, v in point.items())
    return f"{stem}__" + re.sub(r"[^A-Za-z0-9_.=-]+", "-", text)


def peaks(metrics: list[dict]) -> dict[str, float]:
    """Peak memory per device over every phase of every step (MiB)."""
    out: dict[str, float] = {}
    for row in (r for m in metrics for r in m.get("memory", [])):
        if row["metric"] == ("rss" if is_host(row["device"]) else "allocated"):
            key = f"peak_{row['device']}_{row['metric']}_mib"
            out[key] = max(out.get(key, 0.0), row["peak"] / MiB)
    return out


def sweep(
    notebook: Union[str, Path],
    grid: dict[str, list],
    out: Union[str, Path],
    fixed: Optional[dict] = None,
    kernel_name: str = "python3",
) -> Path:
    """Run `notebook` for every point of `grid`; returns DIR with summary.csv and summary.html."""
    import papermill  # noqa: F401  why first: without it (the notebook extra) nothing is checked or written

    notebook, out = Path(notebook).resolve(), Path(out)
    check_sweep(notebook, grid, out, fixed)
    check_output_dir(out, "--out").mkdir(parents=True, exist_ok=True)
    rows, runs = [], []
    for values in itertools.product(*grid.values()):
        row, run = run_point(notebook, out, dict(zip(grid, values)), fixed, kernel_name)
        rows.append(row)
        runs.append(run)
    if len(runs) > 1:  # why first: the summary links to it
        compare(runs, out / "compare.html", title=f"grpo_lab sweep of {notebook.name}: compare the points")
    write_summary(out, rows, list(grid), linked=len(runs) > 1)
    return out


def check_sweep(notebook: Path, grid: dict[str, list], out: Path, fixed: Optional[dict]) -> None:
    """Refuse (LabError) a sweep whose grid, notebook or output directory cannot give a summary, before it runs."""
    if not grid or any(not values for values in grid.values()):
        raise LabError("sweep: the grid is empty; give --grid KEY=V1,V2 with at least one value")
    params = notebook_parameters(notebook)
    unknown = [k for k in [*grid, *(fixed or {})] if k not in params]
    if unknown:
        raise LabError(f"sweep: {unknown} are not parameters of {notebook.name}; its parameters are {sorted(params)}")
    if "results_path" not in params:
        raise LabError(f"sweep: {notebook.name} has no 'results_path' parameter, so its metrics cannot be collected")
    if (out / "summary.csv").exists():
        raise LabError(f"--out: {str(out)!r} already holds a sweep; choose another directory")


def run_point(
    notebook: Path, out: Path, point: dict, fixed: Optional[dict], kernel_name: str
) -> tuple[dict, RunRecord]:
    """Run the notebook at one grid point (DIR/<name>.ipynb): its summary row and its run for the compare page."""
    name = point_name(notebook.stem, point)
    results = (out / f"{name}.jsonl").resolve()
    parameters = {**(fixed or {}), **point, "results_path": str(results)}
    error = execute_point(notebook, out / f"{name}.ipynb", parameters, kernel_name)
    row = {**point, "notebook": f"{name}.ipynb", "error": error}
    metrics = [json.loads(line) for line in results.read_text().splitlines()] if results.is_file() else []
    if metrics:
        last = metrics[-1]
        row.update({k: last[k] for k in ("step", "reward_mean", "loss", "step_seconds")})
    row.update(peaks(metrics))
    run = RunRecord(
        name,
        {"parameters": point},
        metrics,
        status="failed" if row["error"] else "finished",
        error=row["error"],
        label=", ".join(f"{k}={v}" for k, v in point.items()),
    )
    return row, run


def execute_point(notebook: Path, executed: Path, parameters: dict, kernel_name: str) -> str:
    """Execute `notebook` under papermill into `executed`: "" or the error that stopped it (300 characters at most)."""
    import papermill as pm

    try:
        pm.execute_notebook(
            str(notebook),
            str(executed),
            cwd=str(notebook.parent),
            parameters=parameters,
            kernel_name=kernel_name,
            progress_bar=False,
            # why: papermill fails a cell whose output arrives over 4 s (nbclient's default) after its reply; a
            # training cell's output lags that much on a busy machine, and a sweep's point is not wrong for it
            iopub_timeout=IOPUB_TIMEOUT_S,
            # why: no one views a point's widgets; their state (progress bars' included) would only grow its notebook
            store_widget_state=False,
        )
    except pm.PapermillExecutionError as err:
        return f"{err.ename}: {err.evalue}"[:300]
    # why: a kernel killed mid-point (OOM killer: DeadKernelError) is a result, not the end
    except Exception as err:
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:300]
    return ""


def write_summary(out: Path, rows: list[dict], keys: list[str], linked: bool = False) -> None:
    from .files import atomic_write_text

    columns = list(dict.fromkeys(k for r in rows for k in r))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(out / "summary.csv", buffer.getvalue())
    atomic_write_text(out / "summary.html", summary_html(rows, keys, linked))


def summary_html(rows: list[dict], keys: list[str], linked: bool = False) -> str:
    """Peak memory per device against the first swept parameter, a line per setting of the others; with
    `linked`, a link to the sweep's compare.html first."""
    import plotly.graph_objects as go

    x_key, others = keys[0], keys[1:]
    fig = go.Figure()
    peak_columns = sorted({k for r in rows for k in r if k.startswith("peak_")})
    for column in peak_columns:
        groups: dict[tuple, list] = {}
        for r in rows:
            if column in r:
                groups.setdefault(tuple(r[k] for k in others), []).append((r[x_key], r[column]))
        for group, points in groups.items():
            label = column.removeprefix("peak_").removesuffix("_mib") + "".join(
                f" {k}={v}" for k, v in zip(others, group)
            )
            numeric = all(isinstance(p[0], (int, float)) and not isinstance(p[0], bool) for p in points)
            points.sort(key=lambda p: p[0] if numeric else str(p[0]))  # why: 1, 2, 10, not '1', '10', '2'
            fig.add_trace(
                go.Scatter(
                    x=[p[0] if numeric else str(p[0]) for p in points],
                    y=[p[1] for p in points],
                    mode="lines+markers",
                    name=label,
                )
            )
    fig.update_layout(title=f"Peak memory per device against {x_key}", xaxis_title=x_key, yaxis_title="peak MiB")
    link = (
        "<p class='compare-link'><a href='compare.html'>Compare the points</a>: per-phase peaks per device, "
        "reward and loss per step, labelled by their parameters</p>"
        if linked
        else ""
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>grpo_lab sweep</title></head>"
        f"<body style='font-family:sans-serif'>{link}"
        f"{fig.to_html(include_plotlyjs=True, full_html=False)}</body></html>"
    )
