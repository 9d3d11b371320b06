"""Step controls: run the next phase, one step, or N steps (in a worker thread, so the notebook's
other widgets stay live), stop between steps, a progress bar and a log. Errors, out-of-memory
included, land in the log as one line; the Lab stays usable."""
from __future__ import annotations

import threading

from ..errors import LabError
from .editor import _widgets

class StepControls:
    def __init__(self, lab):
        w = _widgets()
        self.lab = lab
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.next_button = w.Button(description=f"phase: {lab.next_phase()}", tooltip="run the next phase of the step")
        self.step_button = w.Button(description="one step")
        self.count = w.BoundedIntText(value=5, min=1, max=100_000, description="steps", layout=w.Layout(width="160px"))
        self.run_button = w.Button(description="run N", button_style="success")
        self.stop_button = w.Button(description="stop", button_style="warning", tooltip="stop after the current step")
        self.progress = w.IntProgress(value=0, min=0, max=1, description="progress")
        self.log = w.Output(layout=w.Layout(max_height="220px", overflow="auto", border="1px solid #ddd"))
        self.next_button.on_click(lambda _: self._guarded(self.next_phase))
        self.step_button.on_click(lambda _: self._guarded(self.one_step))
        self.run_button.on_click(lambda _: self.run(self.count.value))
        self.stop_button.on_click(lambda _: self._stop.set())
        self.widget = w.VBox([w.HBox([self.next_button, self.step_button]),
                              w.HBox([self.count, self.run_button, self.stop_button]), self.progress, self.log])
        self.widget.add_class("grpo-lab-controls")

    def _say(self, text: str) -> None:
        self.log.append_stdout(text + "\n")

    def _guarded(self, fn):
        try:
            return fn()
        except LabError as err:
            self._say(f"error: {err}")

    def next_phase(self) -> str:
        """Run the current step's next phase (the Lab's lifecycle says which) with its earlier phases' outputs."""
        try:
            phase, out = self.lab.run_next_phase()
            self._say(f"{phase} done ({self.lab.timeline.records[-1].seconds:.2f}s)")
            if phase == "sync":
                self._say(out.summary())
        finally:
            self.next_button.description = f"phase: {self.lab.next_phase()}"
        return phase

    def one_step(self):
        try:
            result = self.lab.step()   # the rest of the current step, when a phase walk is under way
        finally:
            self.next_button.description = f"phase: {self.lab.next_phase()}"
        self._say(result.summary())
        return result

    def run(self, steps: int) -> threading.Thread:
        """Run `steps` steps in a worker thread; `stop` ends the run between steps."""
        if self.thread is not None and self.thread.is_alive():
            self._say("a run is in progress; press stop first")
            return self.thread
        self._stop.clear()
        self.progress.max, self.progress.value = steps, 0

        def work():
            for _ in range(steps):
                if self._stop.is_set():
                    self._say("stopped between steps")
                    break
                if self._guarded(self.one_step) is None:
                    break
                self.progress.value += 1

        self.thread = threading.Thread(target=work, name="grpo-lab-run", daemon=True)
        self.thread.start()
        return self.thread
