"""The panel as issue 72 found it, without a browser (widgets are plain objects in Python): a newer panel retires the
older one, stop is on only while a run runs and says what it did, the progress bar says where a run ended, and the
log takes the output's width."""

import threading

from grpo_lab.ui import StepControls


def test_a_newer_panel_turns_the_older_one_off_and_says_which_is_live(loaded_lab):
    """After num_generations was set to 8 in a second panel, the first one's editor still showed 4 and took edits."""
    lab = loaded_lab()
    try:
        first, second = lab.ui(), lab.ui()
        assert all(widget.disabled for widget, _ in first.editor.inputs.values())
        assert first.editor.widget.layout.display == "none"  # hidden: it cannot show a value the config left behind
        assert not second.editor.inputs[("grpo", "learning_rate")][0].disabled
        buttons = first.controls
        assert all(b.disabled for b in (buttons.next_button, buttons.step_button, buttons.run_button))
        assert buttons.stop_button.disabled and buttons.count.disabled
        assert first.note.layout.display == "block" and "panel 1 was replaced by panel 2" in first.note.value
        assert "use panel 2" in first.note.value and second.note.layout.display == "none"
        assert "stopped" in first.plot.fig.layout.title.text and "stopped" not in second.plot.fig.layout.title.text
        assert not first.editor.set("grpo", "learning_rate", "0.5") and lab.config.grpo.learning_rate != 0.5
        assert "use panel 2" in first.editor.errors[("grpo", "learning_rate")].reason
        assert second.editor.set("grpo", "learning_rate", "0.25") and lab.config.grpo.learning_rate == 0.25
        buttons.step_button.click()  # disabled in the browser; refused if clicked anyway
        assert buttons.thread is None and lab.history == [] and "error: panel 1 was replaced" in buttons.log_text()
        third = lab.ui()
        assert "panel 2 was replaced by panel 3" in second.note.value and third.number == 3
        # a saved notebook's fallback: one readable line, not the widget tree
        text = first.mimebundle()["text/plain"]
        assert "\n" not in text and text.startswith("grpo_lab panel 1 (stale: panel 1 was replaced by panel 2")
        assert third.mimebundle()["text/plain"].startswith("grpo_lab panel 3 (config editor, step controls")
        assert "application/vnd.jupyter.widget-view+json" in third.mimebundle()
    finally:
        lab.close()


def held(lab):
    """A reward function that holds each step inside its rewards phase until `release` is set."""
    inside, release = threading.Event(), threading.Event()

    def reward(prompts, completions, **kwargs):
        inside.set()
        if not release.wait(300):
            raise RuntimeError("the test never released the step")
        return [float(len(c)) for c in completions]

    lab.reward_funcs = [reward]
    return inside, release


def test_stop_is_on_only_while_a_run_runs_and_the_bar_says_where_the_run_ended(loaded_lab):
    """Stop was enabled with nothing to stop and did nothing visible; after a stop the bar stayed at 40 % unlabelled."""
    lab = loaded_lab()
    controls = StepControls(lab)
    assert controls.stop_button.disabled and controls.progress.description == "no run yet"
    controls.stop()
    assert controls.log_text().splitlines()[-1] == "stop: nothing is running"
    inside, release = held(lab)
    controls.run(3)
    assert inside.wait(300) and not controls.stop_button.disabled  # a run: stop is on
    controls.stop_button.click()
    release.set()
    controls.thread.join(timeout=300)
    assert controls.stop_button.disabled  # nothing runs: off again
    assert (controls.progress.description, controls.progress.bar_style) == ("stopped at 0 of 3", "warning")
    lines = controls.log_text().splitlines()
    assert (
        "stopped before advantages of step 0" in lines[-2] and lines[-1] == "stop: the run stopped after 0 of 3 steps"
    )
    controls.run(1).join(timeout=300)  # finishes step 0
    assert (controls.progress.description, controls.progress.bar_style) == ("1 of 1 steps", "success")
    lab.reward_funcs = [lambda prompts, completions, **kw: [1.0]]  # a wrong length: the step fails
    controls.run(2).join(timeout=300)
    assert (controls.progress.description, controls.progress.bar_style) == ("error at 0 of 2", "danger")
    assert controls.stop_button.disabled


def test_the_log_takes_the_outputs_width_and_an_empty_one_is_one_line_tall(loaded_lab):
    """The log was a 440 px column beside the editor (each step line wrapped onto 3 lines), an empty 440 x 225 box
    before anything ran."""
    lab = loaded_lab()
    try:
        panel = lab.ui()
        log = panel.controls.log_box
        assert log in panel.widget.children and log.layout.width == "100%" and panel.controls.log.layout.width == "100%"
        assert log not in panel.controls.buttons.children  # not in the buttons' fixed 440 px column
        assert "max-height:220px" in panel.controls.log.value and "'height:220px" not in panel.controls.log.value
    finally:
        lab.close()
