"""A plan made in a Jupyter kernel counts what the kernel holds beside the lab (planner/kernel_share.py): its own
share always, each figure library as the notebook has drawn with it (plotly's figures, matplotlib's PNGs where no one
is there to see them live), and the live plot's where a person's frontend is there to draw it. Notebook 07's first
turns run in a headless kernel before any figure: the plan once counted the live plot's 68 MiB there too (its
undone first turn read 1.10 of its plan on fresh clones; tests/test_story_07.py)."""

import importlib

import pytest

from grpo_lab.config.loading import load_config
from grpo_lab.planner import kernel_share, plan
from grpo_lab.planner.estimate import KERNEL_BASELINE, MiB

PLOTLY, MATPLOTLIB, WIDGET = (m for m, *_ in kernel_share.FIGURE_LIBRARIES)


def shares(live: bool, modules) -> dict[str, float]:
    return {what: nbytes / MiB for what, nbytes, _ in kernel_share.kernel_items(live, modules)}


def test_a_headless_kernel_before_its_first_figure_holds_its_own_share_alone():
    assert shares(False, {"torch", "ipywidgets", "IPython"}) == {"Jupyter kernel: IPython, ipykernel": 20}


@pytest.mark.parametrize(
    "live, modules, total_mib",
    [
        (False, {PLOTLY, MATPLOTLIB}, 20 + 49),  # a headless kernel after a snapshot: 540.8 -> 590.0 measured
        (True, set(), 20 + 68),  # a person's frontend: the live plot it will draw (608.9 measured, with a snapshot)
        (True, {PLOTLY}, 20 + 68),  # (counted once, imported or not)
        (False, {PLOTLY}, 20 + 15),  # the figures drawn as plotly's JSON, no PNG nor widget (556.3 measured)
    ],
)
def test_each_figure_library_counts_once_the_kernel_holds_it(live, modules, total_mib):
    assert sum(shares(live, modules).values()) == total_mib


def test_a_plan_made_in_a_kernel_adds_its_lines_and_nothing_elsewhere(monkeypatch):
    cfg = load_config("tiny-cpu", ["model.name_or_path=builtin:tiny-random"])
    plain = plan(cfg).devices["host"]
    assert not any("kernel" in i.what or "figures" in i.what for i in plain.items)  # pytest is no kernel
    monkeypatch.setattr(kernel_share, "in_kernel", lambda: True)
    monkeypatch.setattr(importlib.import_module("grpo_lab.runtime"), "frontend_is_live", lambda: False)
    monkeypatch.setattr(kernel_share, "imported", lambda: {MATPLOTLIB})
    kernel = plan(cfg).devices["host"]
    added = [i for i in kernel.items if i.what not in {j.what for j in plain.items}]
    assert [i.what for i in added] == ["Jupyter kernel: IPython, ipykernel", "figures: matplotlib"]
    assert kernel.total - plain.total == KERNEL_BASELINE + 34 * MiB and all(i.phase is None for i in added)
