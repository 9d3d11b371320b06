"""What a Jupyter kernel holds beside the plan's HOST_BASELINE, by what it has drawn. The kernel's own share
(ipykernel, IPython: estimate.KERNEL_BASELINE) is always there; the figures' libraries come in as the notebook draws
its first figure and stay: plotly builds every memory figure, matplotlib draws it as a PNG where no one is there to
see it live (papermill, nbconvert: runtime.frontend_is_live), and the live plot (lab.memory_plot(), lab.ui())
imports anywidget with plotly's FigureWidget and its JS bundle where a person's frontend draws it.

Measured on tiny-cpu (`builtin:tiny-random`), RSS as step 1's rollout starts, less the plan's other lines
(bench/probes/process_baseline.py, 2026-12-05, CPU torch 2.13, two rounds each, within 0.3 MiB): a plain process
520.7 MiB; a headless kernel 540.8 (its own: +20); a headless kernel after lab.memory_snapshot() 590.0 (plotly and
matplotlib: +49); a person's kernel after the snapshot alone 556.3 (plotly: +15), with the live plot too 608.9
(+68). A plan made in a kernel counts a library where it is already in the process, and the live plot's where a
person's frontend is there to draw it (a notebook opens it before its steps), so a plan made before the first
figure says what the steps will hold."""

from __future__ import annotations

import sys

from .estimate import KERNEL_BASELINE, MiB, in_kernel

# (the module that says a library is in, the plan's line, its share beside the kernel's own, its note)
FIGURE_LIBRARIES = (
    ("plotly.graph_objs", "figures: plotly", 15 * MiB, "the memory figures (memory_snapshot, the live plot)"),
    ("matplotlib.backends.backend_agg", "figures: matplotlib", 34 * MiB, "the figures as PNGs (no live frontend)"),
    ("anywidget", "live plot: anywidget, plotly's FigureWidget", 53 * MiB, "lab.memory_plot() in a live frontend"),
)
LIVE = ("plotly.graph_objs", "anywidget")  # what a person's frontend will hold: the live plot's libraries


def kernel_items(live: bool, modules) -> list[tuple[str, float, str]]:
    """The host lines of a kernel (what, bytes, note): its own, then each figure library in `modules` (names of
    imported modules) or, where `live` (a person's frontend), the live plot's."""
    items = [("Jupyter kernel: IPython, ipykernel", KERNEL_BASELINE, "this process is a kernel")]
    for module, what, nbytes, note in FIGURE_LIBRARIES:
        if module in modules or (live and module in LIVE):
            items.append((what, nbytes, note))
    return items


def add_kernel_items(host) -> None:
    """A plan made in a Jupyter kernel: its lines on the host (`host` a DevicePlan); none elsewhere."""
    if not in_kernel():
        return
    from ..runtime import frontend_is_live

    for what, nbytes, note in kernel_items(frontend_is_live(), imported()):
        host.add(what, nbytes, note)


def imported() -> set[str]:
    """The names of the modules this process has imported."""
    return set(sys.modules)
