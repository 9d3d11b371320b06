"""Step controls: run the next phase, one step, or N steps (in a worker thread, so the notebook's
other widgets stay live), stop between steps, a progress bar and a log. While a run is in
progress the buttons that would start another are disabled (and refuse if clicked anyway). Every
error, out-of-memory included, lands in the log as one line; the last traceback is one click
away; the Lab stays usable."""
from __future__ import annotations

import threading
import traceback

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
        self.traceback_button = w.Button(description="traceback", tooltip="show the last error's full traceback")
        self.last_traceback = ""
        self.progress = w.IntProgress(value=0, min=0, max=1, description="progress")
        self.log = w.Output(layout=w.Layout(max_height="220px", overflow="auto", border="1px solid #ddd"))
        self.next_button.on_click(lambda _: self._unless_running(self.next_phase))
        self.step_button.on_click(lambda _: self._unless_running(self.one_step))
        self.run_button.on_click(lambda _: self.run(self.count.value))
        self.stop_button.on_click(lambda _: self._stop.set())
        self.traceback_button.on_click(lambda _: self._say(self.last_traceback or "no error yet"))
        self.widget = w.VBox([w.HBox([self.next_button, self.step_button]),
                              w.HBox([self.count, self.run_button, self.stop_button, self.traceback_button]),
                              self.progress, self.log])
        self.widget.add_class("grpo-lab-controls")

    def _say(self, text: str) -> None:
        self.log.append_stdout(text + "\n")

    def _guarded(self, fn):
        """Run fn; any exception becomes one log line (its traceback kept for the traceback button)."""
        try:
            return fn()
        except Exception as err:   # why not only LabError: the panel must survive anything a phase raises
            self.last_traceback = traceback.format_exc()
            line = str(err).strip().splitlines()[0] if str(err).strip() else ""
            self._say(f"error: {line}" if isinstance(err, LabError) else
                      f"error: {type(err).__name__}: {line} (the traceback button shows where)")

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def _unless_running(self, fn):
        if self.running():
            self._say("a run is in progress; wait for it or press stop")
            return None
        return self._guarded(fn)

    def _set_running(self, running: bool) -> None:
        for button in (self.next_button, self.step_button, self.run_button):
            button.disabled = running

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
        if self.running():
            self._say("a run is in progress; wait for it or press stop")
            return self.thread
        self._stop.clear()
        self.progress.max, self.progress.value = steps, 0
        self._set_running(True)   # why before the thread starts: a second click cannot slip in between

        def work():
            try:
                for _ in range(steps):
                    if self._stop.is_set():
                        self._say("stopped between steps")
                        break
                    if self._guarded(self.one_step) is None:
                        break
                    self.progress.value += 1
            finally:
                self._set_running(False)

        self.thread = threading.Thread(target=work, name="grpo-lab-run", daemon=True)
        self.thread.start()
        return self.thread
