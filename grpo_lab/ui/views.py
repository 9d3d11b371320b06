"""What a Lab shows: the live memory plot, the panel, the per-phase memory table, the results a sweep collects, the
placement and the plan, the devices watched, and each rank's state. Read-only views over a Lab's history, memory
sampler and executor (lab.py keeps the state)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from ..errors import LabError


class LabViews:
    def devices(self) -> list[str]:
        """Every device the run uses, as the memory views name them (a sharded learner's: rank<k>/<device>)."""
        return self.executor.devices()

    @property
    def placement(self):
        from ..planner.placement import Placement

        return Placement(self.config, self.executor.generator)

    def plan(self):
        """The per-device memory plan of the current config (nothing is loaded); once loaded, at the longest prompt
        of the data (data/lengths.py) where it is shorter than generator.max_prompt_length."""
        from ..planner import plan

        source = self.prompts
        longest = source.lengths().longest if source is not None and hasattr(source, "lengths") else None
        tools = getattr(self.executor, "tools", None) is not None or None  # (None: the config says)
        return plan(self.config, prompt_tokens=longest, tools=tools)

    def probe(self):
        """One step at the largest shapes the config allows (longest prompt, full-length completions, full
        micro-batches) on the real devices; prints per-phase peaks beside the plan and a verdict; keeps nothing."""
        from ..planner.worst_case import probe

        return probe(self)

    def inspect(self) -> list[dict]:
        """Each rank's LoRA and AdamW state (its shards when sharded), step index and sharding layout: one entry per
        rank, one in one process (for comparisons and tests)."""
        self._require_loaded()
        return self.executor.inspect()

    def memory_plot(self, refresh_s: float = 0.5):
        """The live memory plot (a plotly FigureWidget redrawn every `refresh_s` seconds when new samples arrived);
        display it in a cell. It replaces this Lab's earlier live plot (whose redraw thread stops). In a headless run
        (papermill, nbconvert: runtime.frontend_is_live) a line that says so, and no widget."""
        from ..runtime import frontend_is_live
        from .live import LivePlot, NotLive

        self._require_loaded()
        if not frontend_is_live():  # why: the saved notebook would keep the widget's state, plotly's 5 MB bundle in it
            return NotLive("The live memory plot")
        for old in self._plots:  # why: one live plot per Lab; a new one (a new lab.ui()) replaces the last one's thread
            old.retire("replaced by a newer plot (lab.ui() or lab.memory_plot() ran again)")
        plot = LivePlot(self.memory, refresh_s=refresh_s).start()
        self._plots[:] = [plot]
        return plot

    def memory_snapshot(self, phases: Optional[list] = None) -> None:
        """The memory timeline so far as an image (with its limit lines) and each phase's measured peak per device as
        a table (`phases`: those only): what the live plot shows, kept in a saved notebook or a papermill output."""
        from .story import snapshot

        self._require_loaded()
        snapshot(self, phases)

    def ui(self):
        """The notebook panel: config editor, step controls and the live memory plot; the controls' step count follows
        run.steps as the editor changes it (unless one was typed). It replaces this Lab's earlier panel, whose editor
        and buttons go off with a line saying which panel is live. In a headless run a line that says so, no widget."""
        from ..runtime import frontend_is_live
        from . import Panel
        from .live import NotLive

        if not frontend_is_live():  # why: as memory_plot(); the panel's widgets would all be saved with the notebook
            return NotLive("The panel (config editor, step controls, live memory plot)")
        old = getattr(self, "_panel", None)
        panel = Panel(self, number=old.number + 1 if old else 1)
        panel.editor.on_change = lambda config: panel.controls.follow_config()
        if old is not None:  # why: one live panel per Lab; the last one says which panel is live and takes no edits
            old.retire(panel.number)
        self._panel = panel
        return panel

    def save_results(self, path: Union[str, Path]) -> Path:
        """Every step's metrics (with its memory table) as JSON lines: what `grpo-lab sweep` collects."""
        import json

        from ..files import atomic_write_text

        return atomic_write_text(path, "".join(json.dumps(r.metrics()) + "\n" for r in self.history))

    def save_report(self, path: Union[str, Path] = "report.html") -> Path:
        """The report `grpo-lab run` writes (memory/report.py: the summary per device, the timeline with its phase
        key, a heatmap per device, the rewards with each function's mean, the per-phase table), from this session's
        steps: one self-contained HTML file at `path`, written whole or not at all."""
        from ..memory.report import write_report

        self._require_loaded()
        title = f"grpo_lab notebook session: {self.config.model.name_or_path}, {len(self.history)} steps"
        return write_report(Path(path), self.memory, self.history, title=title, config=self.config.to_dict())

    def memory_table(self, step: Optional[int] = None) -> str:
        """The per-phase memory table (MiB) of `step` (default: the last one): a str, the text `print()` shows, and an
        HTML table on its own in a cell (memory.tables.MemoryTable)."""
        from ..memory.tables import MemoryTable

        if step is None and not self.history:
            raise LabError(
                "lab.memory_table(): no step has finished yet; run lab.step() (or a phase walk up to its sync) first"
            )
        step = self.history[-1].step if step is None else step
        return MemoryTable(self.memory.rows_for(step), step, self.memory.mark_rows(step))

    # --- what a cell shows for the Lab itself ---
    def _summary(self) -> list[tuple[str, str]]:
        from ..memory.readers import MiB

        config, place = self.config, self.config.placement
        ranks = f" x {place.learner_procs} ranks" if place.learner_procs > 1 else ""
        generator = f"{config.generator.backend} on {', '.join(place.generator_devices())}"
        rows = [
            (
                "model",
                f"{config.model.name_or_path} ({'nf4' if config.model.load_in_4bit else config.model.dtype}), "
                f"LoRA r={config.lora.r}",
            ),
            ("placement", f"learner {place.learner}{ranks}, generator {generator}"),
        ]
        if not self.executor.loaded:
            return rows + [("state", "not loaded: lab.load()")]
        rows.append(("step", f"{self.step_index}, next phase {self.next_phase()}"))
        if self.history:
            last = self.history[-1]
            rows.append(("last step", f"reward {last.reward_mean:+.3f}, loss {last.loss:+.4f}"))
            rows += [(f"rewards/{name}/mean", f"{mean:+.3f}") for name, mean in last.rewards.items()]
            peaks: dict = {}
            for r in last.memory or []:
                if r["metric"] in ("rss", "allocated"):
                    peaks[r["device"]] = max(peaks.get(r["device"], 0.0), r["peak"])
            if peaks:
                rows.append(("peak", ", ".join(f"{d} {v / MiB:,.0f} MiB" for d, v in peaks.items())))
        return rows

    def __repr__(self) -> str:
        return "<Lab " + " | ".join(f"{k} {v}" for k, v in self._summary()) + ">"

    def _repr_html_(self) -> str:
        import html

        cells = "".join(
            f"<tr><th style='text-align:left;padding-right:1em'>{k}</th><td style='text-align:left'>"
            f"{html.escape(v)}</td></tr>"
            for k, v in self._summary()
        )
        return f"<b>grpo_lab Lab</b><table>{cells}</table>"
