"""Step controls: run the next phase, one step, or N steps (steps in a worker thread, so the notebook's other widgets
stay live), stop at the next phase boundary, a progress bar of the current run and a log. While anything runs every
button that would start another is disabled (and refuses if clicked anyway) and a line says which phase of which step
is running. Every error, out-of-memory included, lands in the log as one line; the last traceback is one click away;
the log keeps to its box (newest line in view, long lines wrapped) and can be cleared; the Lab stays usable."""

from __future__ import annotations

import html
import threading
import traceback

from ..errors import LabError
from .editor import _widgets

MAX_STEPS = 100_000  # the most steps one "run N" click asks for
LOG_LINES = 500  # why bounded: a long run's log must not grow the notebook's memory (or the widget's state) forever
# column-reverse keeps a scrolled box anchored at its newest (bottom) line; pre-wrap wraps long lines in the box;
# line-height: the HTML widget's own is its 28 px row height, which double-spaced a 12 px log; max-height: an empty log
# is one line tall (it was an empty 440 x 225 box before anything ran), a long one scrolls after 8 lines (the panel's
# buttons, log and plot fit a 679 px view together)
LOG_STYLE = (
    "max-height:132px;min-height:1.4em;overflow:auto;display:flex;flex-direction:column-reverse;"
    "border:1px solid var(--jp-border-color2, #ddd);font-family:monospace;font-size:12px;line-height:1.35;"
    "padding:2px 4px;white-space:pre-wrap;overflow-wrap:anywhere"
)
LINE_STYLE = "padding-left:2em;text-indent:-2em"  # a wrapped line's continuation hangs under its first word
ERROR_STYLE = ";color:var(--jp-error-color1, #c00)"  # an error line in the theme's error colour
TRACEBACK_STYLE = (
    "max-height:300px;overflow:auto;font-size:11px;line-height:1.3;margin:2px 0;padding:2px 4px;"
    "border:1px solid var(--jp-border-color2, #ddd);white-space:pre-wrap"
)


class _RunningLine:
    """A timeline listener: 'running: <phase> of step N' while a phase runs, cleared after."""

    def __init__(self, status):
        self.status = status

    def phase_started(self, step: int, phase: str) -> None:
        self.status.value = f"<b>running:</b> {phase} of step {step}"

    def phase_ended(self, record, error) -> None:
        self.status.value = ""


class StepControls:
    def __init__(self, lab):
        w = _widgets()
        self.lab = lab
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.next_button = w.Button(description=f"phase: {lab.next_phase()}", tooltip="run the next phase of the step")
        self.step_button = w.Button(description="one step", tooltip="the rest of the current step")
        # why text: ipywidgets' IntText turned a typed 2.5 into 25 steps; steps() parses and refuses in the log
        self.count = w.Text(value=str(lab.config.run.steps), description="steps", layout=w.Layout(width="160px"))
        self.count.add_class("grpo-lab-steps")
        self._offered = self.count.value  # what the box last took from run.steps: any other count there was typed
        self.run_button = w.Button(description="run N", button_style="success")
        self.stop_button = w.Button(
            description="stop", button_style="warning", tooltip="stop at the next phase boundary", disabled=True
        )  # (enabled only while a run runs: before, it was on with nothing to stop and did nothing visible)
        fit = w.Layout(width="auto")  # (one model for both buttons)
        self.traceback_button = w.Button(
            description="traceback", tooltip="show the last error's full traceback", layout=fit
        )
        self.clear_button = w.Button(description="clear log", layout=fit)
        self.last_traceback = ""
        self.status = w.HTML(value="")
        # the bar's label says how the last run ended: "2 of 5 steps", "stopped at 2 of 5", "error at 2 of 5"
        self.progress = w.IntProgress(
            value=0, min=0, max=1, description="no run yet", style={"description_width": "initial"}
        )
        self.retired: str | None = None  # why this panel's controls are off (a newer panel replaced it)
        self.lines: list[str] = []
        # why no side margins: ipywidgets' 2 px each side made the log 4 px wider than its box (a scrollbar under it)
        full = dict(width="100%", margin="2px 0")
        self.log = w.HTML(value="", layout=w.Layout(**full))
        # why a box of its own: a traceback in the log's 220 px box pushed the step lines out of view
        self.traceback = w.HTML(value="", layout=w.Layout(**full, display="none"))
        self.next_button.on_click(lambda _: self._unless_running(self.next_phase))
        self.step_button.on_click(lambda _: self.run(1))
        self.run_button.on_click(lambda _: self._run_count())
        self.stop_button.on_click(lambda _: self.stop())
        self.traceback_button.on_click(lambda _: self.show_traceback())
        self.clear_button.on_click(lambda _: self.clear())
        lab.timeline.listeners.append(_RunningLine(self.status))
        self._lay_out(w)
        self.widget = w.VBox([self.buttons, self.log_box], layout=w.Layout(width="100%"))
        self._render()

    def _lay_out(self, w) -> None:
        # one row of buttons that wraps (two rows in an 848 px output), the log under it at the output's width (in a
        # 440 px column every step line wrapped onto 3 lines): the panel keeps both above the plot, on one screen
        self.buttons = w.HBox(
            [
                self.next_button,
                self.step_button,
                self.count,
                self.run_button,
                self.stop_button,
                self.progress,
                self.traceback_button,
                self.clear_button,
                self.status,
            ],
            layout=w.Layout(width="100%", flex_flow="row wrap", align_items="center"),
        )
        self.buttons.add_class("grpo-lab-controls")
        self.log_box = w.VBox([self.log, self.traceback], layout=w.Layout(width="100%"))
        self.log_box.add_class("grpo-lab-log-box")

    # --- the log ---
    def _say(self, text: str) -> None:
        self.lines.extend(text.rstrip("\n").split("\n"))
        del self.lines[:-LOG_LINES]
        self._render()

    def _render(self) -> None:
        body = "".join(
            f"<div style='{LINE_STYLE}{ERROR_STYLE if line.startswith('error:') else ''}'>"
            f"{html.escape(line, quote=False) or '&nbsp;'}</div>"
            for line in self.lines
        )
        self.log.value = f"<div class='grpo-lab-log' style='{LOG_STYLE}'><div>{body}</div></div>"

    def log_text(self) -> str:
        return "\n".join(self.lines) + ("\n" if self.lines else "")

    def clear(self) -> None:
        self.lines.clear()
        self._render()
        self.traceback.layout.display = "none"

    def show_traceback(self) -> None:
        """The last error's traceback in its own box under the log (shown, or hidden again on a second click)."""
        if self.traceback.layout.display != "none":
            self.traceback.layout.display = "none"
            return
        text = html.escape(self.last_traceback or "no error yet", quote=False)
        self.traceback.value = f"<pre style='{TRACEBACK_STYLE}'>{text}</pre>"
        self.traceback.layout.display = "block"

    def _guarded(self, fn):
        """Run fn; any exception becomes one log line (its traceback kept for the traceback button)."""
        try:
            return fn()
        except Exception as err:  # why not only LabError: the panel must survive anything a phase raises
            self.last_traceback = traceback.format_exc()
            line = str(err).strip().splitlines()[0] if str(err).strip() else ""
            where = " (the traceback button shows where)"  # (a LabError caused by user code, e.g. a reward's, too)
            self._say(
                f"error: {line}" + (where if err.__cause__ is not None else "")
                if isinstance(err, LabError)
                else f"error: {type(err).__name__}: {line}{where}"
            )

    # --- running ---
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def _refused(self) -> bool:
        """Whether a start is refused (said in the log): a run in progress, or a panel a newer one replaced."""
        if self.retired is not None:
            self._say(f"error: {self.retired}")
            return True
        if self.running():
            self._say("a run is in progress; wait for it or press stop")
            return True
        return False

    def _unless_running(self, fn):
        if self._refused():
            return None
        self._set_running(True)
        try:
            return self._guarded(fn)
        finally:
            self._set_running(False)

    def _set_running(self, running: bool, stoppable: bool = False) -> None:
        """The buttons that start a run are off while one runs (and for good on a replaced panel); stop is on only
        while a run in the worker thread can hear it (a phase button's phase runs in the kernel: no click gets in)."""
        for button in (self.next_button, self.step_button, self.run_button):
            button.disabled = running or self.retired is not None
        self.count.disabled = self.retired is not None
        self.stop_button.disabled = not (running and stoppable)

    def retire(self, why: str) -> None:
        """A newer panel replaced this one: its buttons are off (stop stays on while this panel's own run runs)."""
        self.retired = why
        self._set_running(self.running(), stoppable=self.running())

    def stop(self) -> None:
        if self.running():
            self._stop.set()
            self._say("stop: the run stops at the next phase boundary (the step's phase under way finishes first)")
        else:
            self._say("stop: nothing is running")

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
        """The rest of the current step, a phase at a time (stop is honoured at each boundary); its result, or None."""
        try:
            if self.lab.executor.loaded:
                self.lab.executor.check_learner()  # as lab.step(): a wrap in a cell is refused before the step
            while True:
                if self._stop.is_set():
                    self._say(
                        f"stopped before {self.lab.next_phase()} of step {self.lab.step_index}; "
                        "'one step' (or lab.step()) finishes it"
                    )
                    return None
                phase, out = self.lab.run_next_phase()
                if phase == "sync":
                    self._say(out.summary())
                    return out
        finally:
            self.next_button.description = f"phase: {self.lab.next_phase()}"

    def _ended(self, how: str, steps: int) -> None:
        """The bar's label and colour say how the run ended; a stop also says in the log where the run stopped."""
        done = self.progress.value
        label, style = {
            "done": (f"{done} of {steps} steps", "success"),
            "stopped": (f"stopped at {done} of {steps}", "warning"),
            "error": (f"error at {done} of {steps}", "danger"),
        }[how]
        self.progress.description, self.progress.bar_style = label, style
        if how == "stopped":
            self._say(f"stop: the run stopped after {done} of {steps} steps")
        elif how == "done" and self._stop.is_set():  # stop came during the last step: nothing was left to stop
            self._say(f"stop: the run had finished its {steps} steps before the next phase boundary")

    def follow_config(self) -> None:
        """Show run.steps in the step count, unless the user typed another count there (never changed under them)."""
        if self.count.value == self._offered:
            self.count.value = self._offered = str(self.lab.config.run.steps)

    def steps(self) -> int | None:
        """The step count in the panel (run.steps unless one was typed), or None after saying in the log why it is
        not one."""
        self.follow_config()
        text = self.count.value.strip()
        if text.isdigit() and 1 <= int(text) <= MAX_STEPS:
            return int(text)
        self._say(f"error: steps: {text!r} is not a whole number of steps from 1 to {MAX_STEPS:,}; type one, e.g. 5")
        return None

    def _run_count(self) -> None:
        steps = self.steps()
        if steps is not None:
            self.run(steps)

    def run(self, steps: int) -> threading.Thread:
        """Run `steps` steps in a worker thread ('one step' is a run of 1); `stop` ends it at the next phase
        boundary."""
        if self._refused():
            return self.thread
        self._stop.clear()
        self.progress.max, self.progress.value = steps, 0  # why here: the bar belongs to this run, not the last
        self.progress.description, self.progress.bar_style = f"0 of {steps} steps", ""
        self._set_running(True, stoppable=True)  # why before the thread starts: a second click cannot slip in between

        def work():
            ended = "error"
            try:
                for _ in range(steps):
                    if self._guarded(self.one_step) is None:
                        ended = "stopped" if self._stop.is_set() else "error"
                        break
                    self.progress.value += 1
                    self.progress.description = f"{self.progress.value} of {steps} steps"
                else:
                    ended = "done"
            finally:
                self._ended(ended, steps)
                self._set_running(False)
                self.follow_config()  # why: run.steps may have been edited while it ran

        self.thread = threading.Thread(target=work, name="grpo-lab-run", daemon=True)
        self.thread.start()
        return self.thread
