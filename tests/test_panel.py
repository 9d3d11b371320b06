"""The panel as issue 72 found it, without a browser (widgets are plain objects in Python): a newer panel retires the
older one, stop is on only while a run runs and says what it did, the progress bar says where a run ended, and the
log takes the output's width."""

import threading

from grpo_lab.algo.phases import PHASE_NAMES as PHASES
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
        assert log not in panel.controls.buttons.children and panel.controls.buttons.layout.width == "100%"
        assert "max-height:132px" in panel.controls.log.value and "'height:" not in panel.controls.log.value
    finally:
        lab.close()


def test_a_limit_reads_the_same_in_the_live_plot_the_snapshot_and_the_plan(loaded_lab):
    """One limit read "23.5 GiB" in the live plot, "24,105 MiB" in the snapshot and "23.54 GiB" in the plan."""
    from grpo_lab.memory.report import capacities_of, sampler_timeline
    from grpo_lab.memory.tables import size_text

    lab = loaded_lab(placement={"host_memory_gib": 12.3456})
    try:
        plot = lab.memory_plot()
        lab.step()
        plot.refresh()
        limit = size_text(capacities_of(lab.memory)["host"])
        assert limit == "12.35 GiB"
        said = [a.text for a in plot.fig.layout.annotations] + [plot.fig.layout.title.text]
        assert any(f"host limit: {limit}" in text for text in said), said  # drawn or named off scale
        snapshot = [a.text for a in sampler_timeline(lab.memory).layout.annotations]
        assert any(f"host limit: {limit}" in text for text in snapshot), snapshot
        planned = [line.split() for line in str(lab.plan()).splitlines() if line.strip().startswith("capacity")]
        assert " ".join(planned[-1][1:]) == limit  # the host's block is the plan's last
    finally:
        lab.close()


def test_every_step_is_labelled_or_the_title_says_which_are():
    """Steps 3 and 6 had no label (a label too near the last one was dropped without a word)."""
    from grpo_lab.algo.phases import PHASE_NAMES
    from grpo_lab.memory.figures import timeline_figure

    def figure(steps):
        marks = [(s, p, s * 7.0 + i, s * 7.0 + i + 1) for s in range(steps) for i, p in enumerate(PHASE_NAMES)]
        samples = [(t * 0.5, int(t // 14), "rollout", "host", "rss", 100 * 2**20) for t in range(steps * 14)]
        fig = timeline_figure(samples, marks)
        return fig, sorted(int(a.text.split()[1]) for a in fig.layout.annotations if a.name == "step-label")

    few, labelled = figure(10)
    assert labelled == list(range(10)) and "step labelled" not in few.layout.title.text
    many, labelled = figure(20)  # 5 % of the view each: every other label would overlap
    assert labelled == list(range(0, 20, 2)) and "every 2nd step labelled" in many.layout.title.text


def test_phase_bands_are_strong_enough_for_a_dark_theme_and_drawn_under_the_lines(loaded_lab):
    from grpo_lab.memory.figures import BAND_OPACITY
    from grpo_lab.memory.report import sampler_timeline

    lab = loaded_lab()
    try:
        plot = lab.memory_plot()
        lab.step()
        plot.refresh()
        for shapes in (plot.fig.layout.shapes, sampler_timeline(lab.memory).layout.shapes):
            bands = [s for s in shapes if s.type == "rect" and s.name in PHASES]
            assert bands and all(s.opacity == BAND_OPACITY >= 0.25 and s.layer == "between" for s in bands)
    finally:
        lab.close()


def test_a_snapshot_of_some_phases_shows_only_those_in_its_image_too(loaded_lab, monkeypatch):
    """memory_snapshot(phases=[...]) narrowed the table but not the image."""
    import grpo_lab.ui.story as story

    lab = loaded_lab()
    try:
        lab.step()
        shown = []
        monkeypatch.setattr(story, "show", shown.append)
        lab.memory_snapshot(phases=["rollout", "backward"])
        (fig,) = shown
        bands = {s.name for s in fig.layout.shapes if s.type == "rect" and s.name in PHASES}
        assert bands == {"rollout", "backward"} and "phases: rollout, backward" in fig.layout.title.text
        labels = {a.text for a in fig.layout.annotations if a.name == "band-label"}
        assert labels <= {"rollout", "backward"}
    finally:
        lab.close()


def visible(help_value: str) -> str:
    """What a help line shows before a click: its text, a folded help's summary only."""
    import re

    shown = help_value.split("</summary>")[0]
    return re.sub(r"<[^>]+>", "", shown).replace("&#10003;", "v")


def test_the_editor_reads_lighter_badges_folded_help_and_cuda_fields_marked_on_a_cpu_lab(tiny_config):
    """Every load-time field repeated its 80-character '[load: ...]' note (8 times on the model tab), a 791-character
    help showed whole, and CUDA-only fields showed on a CPU Lab as any other."""
    from grpo_lab.config.schema import LabConfig
    from grpo_lab.ui import ConfigEditor
    from grpo_lab.ui.field_help import FOLD_AT

    editor = ConfigEditor(LabConfig.model_validate(tiny_config()))
    cuda = {key for key, prop in editor.props.items() if prop.get("cuda_only")}
    assert {("memory", "cuda_snapshots"), ("generator", "sleep_mode"), ("placement", "gpu_memory_gib")} <= cuda
    for key, line in editor.help.items():
        badge = ">load-time<" if editor.props[key]["when"] == "load" else ">live<"
        assert badge in line.value or ">rebuild<" in line.value, key
        assert len(visible(line.value)) <= FOLD_AT + len("load-timeCUDA only …"), (key, visible(line.value))
        assert ("grpo-lab-badge-cuda" in line.value) == (key in cuda), key
        assert editor.props[key]["description"] in editor.inputs[key][0].tooltip  # the whole help, on hover
    folded = [key for key, line in editor.help.items() if "<details>" in line.value]
    assert ("memory", "cuda_expandable_segments") in folded
    on_gpu = ConfigEditor(LabConfig.model_validate(tiny_config(placement={"learner": "cuda:0"})))
    assert not any("grpo-lab-badge-cuda" in line.value for line in on_gpu.help.values())


def test_a_refused_field_is_framed_red_and_an_applied_one_ticked(tiny_config):
    """A refused field's border stayed focus-blue; an accepted value got no sign."""
    from grpo_lab.config.schema import LabConfig
    from grpo_lab.ui import ConfigEditor

    editor = ConfigEditor(LabConfig.model_validate(tiny_config()))
    beta, lr = editor.inputs[("grpo", "beta")][0], editor.inputs[("grpo", "learning_rate")][0]
    beta.value = "-1"
    assert "grpo-lab-refused" in beta._dom_classes and "applied" not in editor.help[("grpo", "beta")].value
    beta.value = "0.2"
    assert "grpo-lab-refused" not in beta._dom_classes and "grpo-lab-applied" in beta._dom_classes
    assert "applied: 0.2" in editor.help[("grpo", "beta")].value
    lr.value = "0.002"  # the next edit: its tick, the last one's cleared
    assert "applied: 0.002" in editor.help[("grpo", "learning_rate")].value
    assert "applied" not in editor.help[("grpo", "beta")].value and "grpo-lab-applied" not in beta._dom_classes
    lr.value = "abc"
    assert "grpo-lab-refused" in lr._dom_classes
    editor.errors[("grpo", "learning_rate")].widget.children[1].click()  # revert
    assert "grpo-lab-refused" not in lr._dom_classes and "applied" not in editor.help[("grpo", "learning_rate")].value


def test_the_panel_puts_the_controls_log_and_plot_first_and_the_editor_pages_are_one_height(loaded_lab):
    """The panel was 2,321 px tall on the grpo tab and a tab switch moved the buttons and the plot by up to 1,254 px
    (the browser test measures it at 1280 x 800: tests/test_browser_panel.py)."""
    from grpo_lab.ui.editor import EDITOR_HEIGHT

    lab = loaded_lab()
    try:
        panel = lab.ui()
        style, note, *shown = panel.widget.children  # (the plot's theme style and a stale panel's note: hidden)
        assert style.layout.display == note.layout.display == "none"
        assert shown == [panel.controls.buttons, panel.controls.log_box, panel.plot.fig, panel.editor.widget]
        pages = list(panel.editor.sections.values())
        assert {(p.layout.height, p.layout.overflow) for p in pages} == {(EDITOR_HEIGHT, "auto")}
        assert all("grpo-lab-page" in p._dom_classes for p in pages)  # rows never shrink inside (EDITOR_CSS)
        assert panel.plot.fig.layout.height <= 400
    finally:
        lab.close()
