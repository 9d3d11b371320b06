"""What a Lab shows: the live memory plot, the panel, the per-phase memory table and the results a sweep collects.
Read-only views over a Lab's history and memory sampler (lab.py keeps the state)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from .errors import LabError


class LabViews:
    def memory_plot(self, refresh_s: float = 0.5):
        """The live memory plot (a plotly FigureWidget redrawn every `refresh_s` seconds); display it in a cell."""
        from .memory.live import LivePlot

        self._require_loaded()
        plot = LivePlot(self.memory, refresh_s=refresh_s).start()
        self._plots.append(plot)
        return plot

    def ui(self):
        """The notebook panel: config editor, step controls and the live memory plot."""
        from .ui import Panel

        return Panel(self)

    def save_results(self, path: Union[str, Path]) -> Path:
        """Every step's metrics (with its memory table) as JSON lines: what `grpo-lab sweep` collects."""
        import json

        from .io import atomic_write_text

        return atomic_write_text(path, "".join(json.dumps(r.metrics()) + "\n" for r in self.history))

    def memory_table(self, step: Optional[int] = None) -> str:
        """The per-phase memory table (MiB) of `step` (default: the last one)."""
        from .memory import format_table

        if step is None and not self.history:
            raise LabError("lab.memory_table(): no step has finished yet; run lab.step() (or a phase walk up to its "
                           "sync) first")
        step = self.history[-1].step if step is None else step
        return format_table(self.memory.rows_for(step))
