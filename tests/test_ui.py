"""Widget logic without a browser: the editor validates edits, the buttons run phases and steps."""

import threading

import pytest

from grpo_lab import Lab
from grpo_lab.algo.phases import PHASE_NAMES as PHASES
from grpo_lab.ui import ConfigEditor, Panel, StepControls


def test_editor_has_a_tab_per_section_typed_inputs_and_help(tiny_config):
    lab = Lab(tiny_config())
    editor = ConfigEditor(lab.config)
    assert [editor.tabs.get_title(i) for i in range(len(editor.tabs.children))] == list(type(lab.config).model_fields)
    beta, _ = editor.inputs[("grpo", "beta")]
    assert type(beta).__name__ == "Text" and "KL" in beta.tooltip  # numbers are typed as text (issue 40)
    loss, _ = editor.inputs[("grpo", "loss_type")]
    assert type(loss).__name__ == "Dropdown" and set(loss.options) == {"grpo", "bnpo", "dr_grpo", "dapo"}
    assert type(editor.inputs[("model", "load_in_4bit")][0]).__name__ == "Checkbox"


def test_valid_edit_updates_the_config_and_the_lab(tiny_config):
    lab = Lab(tiny_config())
    editor = ConfigEditor(lab.config)
    editor.inputs[("grpo", "beta")][0].value = "0.2"
    editor.inputs[("generator", "chunk_size")][0].value = "3"
    assert lab.config.grpo.beta == 0.2 and lab.config.generator.chunk_size == 3
    # when it applies, no error
    assert editor.message.value == "generator.chunk_size: read at the next phase that uses it"
    editor.inputs[("generator", "chunk_size")][0].value = "null"
    assert lab.config.generator.chunk_size is None


@pytest.mark.parametrize(
    "section, name, bad, field",
    [
        ("grpo", "num_generations", "1", "grpo.num_generations"),
        ("grpo", "beta", "-1.0", "grpo.beta"),
        ("generator", "chunk_size", "0", "generator.chunk_size"),
        ("placement", "learner", "gpu", "placement.learner"),
    ],
)
def test_invalid_edit_shows_its_reason_under_its_field_and_keeps_what_was_typed(tiny_config, section, name, bad, field):
    """Issue 34: the reason sat under the tabs, 1,665 px from the field, and the field quietly reverted."""
    lab = Lab(tiny_config())
    editor = ConfigEditor(lab.config)
    before = lab.config.to_dict()
    widget, error = editor.inputs[(section, name)][0], editor.errors[(section, name)]
    widget.value = bad
    assert error.reason.startswith(field) and error.widget.layout.display == "flex" and "\n" not in error.reason
    assert "(not applied; stays " in error.reason and lab.config.to_dict() == before
    assert widget.value == bad and editor.message.value == ""  # what was typed stays in view
    editor.inputs[("grpo", "learning_rate")][0].value = "0.002"  # another field's edit refreshes the others...
    assert widget.value == bad and lab.config.grpo.learning_rate == 0.002  # ...but not the one waiting
    error.widget.children[1].click()  # revert
    assert error.reason is None and error.widget.layout.display == "none"
    assert (
        widget.value == editor.inputs[(section, name)][0].value
        and lab.config.to_dict()[section][name] == before[section][name]
    )
    assert str(widget.value) != str(bad)


def test_editor_on_a_loaded_lab_edits_it_in_place_and_locks_load_time_fields(loaded_lab, tmp_path):
    lab = loaded_lab()
    editor = lab.ui().editor
    assert editor.config is lab.config
    assert editor.inputs[("lora", "r")][0].disabled and editor.inputs[("model", "dtype")][0].disabled
    assert not editor.inputs[("grpo", "learning_rate")][0].disabled
    assert "[live: read at the next phase that uses it]" in editor.inputs[("generator", "chunk_size")][0].tooltip
    editor.inputs[("generator", "chunk_size")][0].value = "4"
    assert lab.config.generator.chunk_size == 4 and "next phase" in editor.message.value
    assert lab.rollout().generate_calls == 2  # 8 sequences, 4 per call: the edit took effect
    assert not editor.set("lora", "r", 32)  # what a disabled input cannot send, set() refuses
    assert editor.errors[("lora", "r")].reason.startswith("lora.r: fixed when the Lab loads") and lab.config.lora.r == 8
    other = lab.config.to_dict()
    other["model"]["dtype"] = "bfloat16"
    other["grpo"]["beta"] = 0.5
    import yaml

    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    editor.load(str(tmp_path / "other.yaml"))  # all or nothing: beta is not applied either
    assert "model.dtype: fixed when the Lab loads" in editor.message.value and lab.config.grpo.beta != 0.5
    lab.close()  # (its plot's redraw thread stops)


def test_editor_saves_and_loads_yaml(tiny_config, tmp_path):
    editor = ConfigEditor(Lab(tiny_config()).config)
    editor.inputs[("grpo", "beta")][0].value = "0.3"
    editor.save(str(tmp_path / "c.yaml"))
    other = ConfigEditor(Lab(tiny_config()).config)
    other.load(str(tmp_path / "c.yaml"))
    assert other.config.grpo.beta == 0.3 and other.inputs[("grpo", "beta")][0].value == "0.3"
    other.load(str(tmp_path / "missing.yaml"))
    assert "missing.yaml' is neither a YAML file nor a preset" in other.message.value
    assert other.config.grpo.beta == 0.3  # a failed load leaves the config as it was


def test_buttons_run_phases_a_step_and_n_steps(loaded_lab):
    lab = loaded_lab()
    controls = StepControls(lab)
    for phase in PHASES:
        assert controls.next_button.description == f"phase: {phase}"
        controls.next_button.click()
    # the walk's last phase ended step 0 by itself: its result is in history, the index moved on
    assert [r.phase for r in lab.timeline.records] == list(PHASES) and lab.step_index == 1 and len(lab.history) == 1
    assert controls.next_button.description == "phase: rollout"
    click_step(controls)
    assert len(lab.history) == 2
    controls.next_button.click()  # a walk begun, then "one step" runs the rest of that step
    click_step(controls)
    assert len(lab.history) == 3 and lab.history[-1].step == 2
    controls.count.value = "2"
    controls.run_button.click()
    controls.thread.join(timeout=300)
    assert not controls.thread.is_alive()
    assert len(lab.history) == 5 and controls.progress.value == 2 and [r.step for r in lab.history] == [0, 1, 2, 3, 4]


def log_text(controls):
    return controls.log_text()


def click_step(controls):
    """'one step' runs in a worker thread (its buttons disabled meanwhile): click and wait for it."""
    controls.step_button.click()
    if controls.thread is not None:
        controls.thread.join(timeout=300)


def test_stop_ends_a_run_between_steps_and_errors_keep_the_lab_usable(loaded_lab):
    """Stop is clicked while step 1 of a 5-step run is inside its rewards phase (held there by the reward
    function until the test lets it go): step 1 finishes, step 2 never starts."""
    lab = loaded_lab()
    controls = StepControls(lab)
    inside_step_1, release = threading.Event(), threading.Event()
    calls = []

    def held_length(prompts, completions, **kwargs):
        calls.append(lab.step_index)
        if lab.step_index == 1:
            inside_step_1.set()
            if not release.wait(300):
                raise RuntimeError("the test never released step 1")
        return [float(len(c)) for c in completions]

    lab.reward_funcs = [held_length]
    controls.run(5)
    assert inside_step_1.wait(300), "the run never reached step 1"
    assert controls.thread.is_alive() and len(lab.history) == 1 and controls.progress.value == 1
    controls.stop_button.click()  # the user presses stop while step 1 runs
    release.set()
    controls.thread.join(timeout=300)
    assert not controls.thread.is_alive()
    # stopped at the next phase boundary: after step 1's rewards, before its advantages
    assert calls == [0, 1] and [r.step for r in lab.history] == [0] and controls.progress.value == 1
    assert lab.step_index == 1 and lab.next_phase() == "advantages"
    assert log_text(controls).count("stopped before advantages of step 1") == 1
    click_step(controls)  # 'one step' finishes that step
    assert [r.step for r in lab.history] == [0, 1]

    lab.config.grpo.micro_batch_size = 4
    lab.reward_funcs = [lambda prompts, completions, **kw: [1.0]]  # wrong length -> LabError
    click_step(controls)
    assert "error: reward '<lambda>' returned 1 values for 8 completions" in log_text(controls)
    assert len(lab.history) == 2 and lab.step_index == 2
    lab.reward_funcs = [lambda prompts, completions, **kw: [float(len(c)) for c in completions]]
    click_step(controls)
    assert [r.step for r in lab.history] == [0, 1, 2] and lab.step_index == 3


def test_panel_combines_editor_controls_and_plot(loaded_lab):
    lab = loaded_lab()
    panel = lab.ui()
    lab.close()  # its plot's redraw thread stops (a test counting them in this process must not find it)
    assert isinstance(panel, Panel) and panel.plot is not None
    # the theme's style for the plot, a stale panel's note (hidden), the buttons, the log, the plot, the editor
    style, note, buttons, log, plot, editor = panel.widget.children
    assert "data-jp-theme-light" in style.value and (buttons, editor) == (panel.controls.buttons, panel.editor.widget)
    assert note.layout.display == "none" and log is panel.controls.log_box
    assert plot is panel.plot.fig and "grpo-lab-plot" in plot._dom_classes


def held_at_rewards(lab):
    """StepControls on `lab` whose reward function holds every step inside its rewards phase: (controls, `inside`
    set once a step is held there, `release` to let it go)."""
    controls = StepControls(lab)
    inside, release = threading.Event(), threading.Event()

    def held(prompts, completions, **kwargs):
        inside.set()
        if not release.wait(300):
            raise RuntimeError("the test never released the step")
        return [float(len(c)) for c in completions]

    lab.reward_funcs = [held]
    return controls, inside, release


def test_a_run_cannot_be_started_twice_and_cells_cannot_interleave_with_it(loaded_lab):
    """While a run is inside step 0 (its reward function held), a second click on run, on one step or on the
    phase button starts nothing, the buttons are disabled, and a cell's lab.step() is refused in one line;
    the run then finishes its 2 steps and the buttons come back."""
    from grpo_lab import LabError

    lab = loaded_lab()
    controls, inside, release = held_at_rewards(lab)
    controls.count.value = "2"
    controls.run_button.click()
    controls.run_button.click()  # a quick second click
    assert inside.wait(300), "the run never reached its rewards phase"
    assert controls.next_button.disabled and controls.step_button.disabled and controls.run_button.disabled
    controls.step_button.click()  # disabled in the browser; refused if clicked anyway
    controls.next_button.click()
    with pytest.raises(LabError, match=r"^rewards: another phase of this Lab is running") as err:
        lab.step()  # a cell: the step's next phase is the one the run is in
    assert "\n" not in str(err.value)
    release.set()
    controls.thread.join(timeout=300)
    assert not controls.thread.is_alive()
    assert len(lab.history) == 2 and [r.step for r in lab.history] == [0, 1]  # one run of 2 steps, nothing more
    assert log_text(controls).count("a run is in progress") == 3
    assert not (controls.next_button.disabled or controls.step_button.disabled or controls.run_button.disabled)


def test_any_error_is_one_log_line_with_the_traceback_on_demand(loaded_lab):
    lab = loaded_lab()
    controls = StepControls(lab)

    def broken(prompts, completions, **kwargs):
        raise ValueError("the reward server is down\nsecond line")

    lab.reward_funcs = [broken]
    click_step(controls)
    lines = [line for line in log_text(controls).splitlines() if line]
    # the line names the reward (algo/reward_calls.py), and its own traceback is a button away
    assert lines == [
        "error: reward 'broken' raised ValueError: the reward server is down (the traceback button shows where)"
    ]
    assert "var(--jp-error-color1" in controls.log.value  # the error line in the theme's error colour
    controls.traceback_button.click()  # the traceback in its own box, not in the log
    text = controls.traceback.value
    assert "Traceback (most recent call last)" in text and "def broken" not in text and "in broken" in text
    assert controls.traceback.layout.display == "block" and "Traceback" not in log_text(controls)
    lab.reward_funcs = [lambda prompts, completions, **kw: [float(len(c)) for c in completions]]
    click_step(controls)  # the Lab stayed usable
    assert len(lab.history) == 1


def test_text_inputs_show_plain_literals_and_apply_on_enter_or_blur(tiny_config):
    """Issue 25's first complaint: YAML's document-end marker made micro_batch_size read '4...', and every keystroke
    was applied (and refused: '4..'). Values show as plain literals; text inputs apply on Enter or blur only."""
    from grpo_lab.ui.editor import as_text

    assert [as_text(v) for v in (4, 3.0, "adapter-disabled", None, True, ["q_proj", "v_proj"])] == [
        "4",
        "3.0",
        "adapter-disabled",
        "null",
        "true",
        "[q_proj, v_proj]",
    ]
    editor = ConfigEditor(Lab(tiny_config()).config)
    widget, _ = editor.inputs[("grpo", "micro_batch_size")]
    assert widget.value == "null" and widget.continuous_update is False
    widget.value = "2"  # what Enter or blur delivers
    assert editor.config.grpo.micro_batch_size == 2 and widget.value == "2"
    widget.value = "4"
    assert editor.config.grpo.micro_batch_size == 4 and widget.value == "4"
    assert all(getattr(w, "continuous_update", False) is False for w, _ in editor.inputs.values())


def test_every_field_shows_its_help_and_when_it_takes_effect_under_it(tiny_config):
    """Tooltips are unreliable in ipywidgets 8 (dropped on text, dropdown and checkbox inputs with a description):
    each field's help and its live / rebuild / load-time badge is a line under it (issue 72: a badge, not the same
    80-character note under every field)."""
    from grpo_lab.config.schema import field_when

    editor = ConfigEditor(Lab(tiny_config()).config)
    for (section, name), help_line in editor.help.items():
        assert f"grpo-lab-badge-{field_when(f'{section}.{name}')}'" in help_line.value, (section, name)
        assert "[load:" not in help_line.value and "[live:" not in help_line.value  # (its meaning: the badge title)
    kinds = {type(editor.inputs[key][0]).__name__ for key in editor.help}
    assert kinds == {"Text", "Dropdown", "Checkbox"}  # numbers are typed as text (issue 40)
    assert len(editor.help) == len(editor.inputs)


def test_a_lab_shows_what_it_is_not_its_address(loaded_lab):
    """The load cell ended with '<grpo_lab.lab.Lab at 0x7f...>'. A Lab's repr and HTML say model, placement, step,
    next phase, the last step's reward and its peak memory."""
    assert "not loaded: lab.load()" in repr(Lab("tiny-cpu"))
    lab = loaded_lab()
    try:
        lab.step()
        text, page = repr(lab), lab._repr_html_()
        for words in (
            lab.config.model.name_or_path,
            f"learner {lab.config.placement.learner}",
            "1, next phase rollout",
            f"reward {lab.history[-1].reward_mean:+.3f}",
            "host ",
        ):
            assert words in text and words in page, (words, text)
        assert "step 1, next phase rollout" in text and "peak host" in text
        assert " at 0x" not in text
    finally:
        lab.close()


def test_one_step_disables_the_buttons_says_what_runs_and_stops_at_a_phase_boundary(loaded_lab):
    """Two quick clicks on 'one step' ran two steps, nothing said a step was running, and stop during one step did
    nothing. Now 'one step' is a run of one: buttons disabled while it runs, 'running: <phase> of step N' shown,
    a second click refused, stop honoured at the next phase boundary and said in the log; the log can be cleared."""
    lab = loaded_lab()
    controls, inside, release = held_at_rewards(lab)
    controls.progress.value = controls.progress.max = 7  # a bar left over from an earlier run
    controls.step_button.click()
    controls.step_button.click()  # the quick second click
    assert inside.wait(300)
    assert controls.step_button.disabled and controls.next_button.disabled and controls.run_button.disabled
    assert controls.status.value == "<b>running:</b> rewards of step 0"
    assert (controls.progress.value, controls.progress.max) == (0, 1)  # the bar is this run's
    controls.stop_button.click()
    release.set()
    controls.thread.join(timeout=300)
    text = log_text(controls)
    assert "a run is in progress" in text and "stopped before advantages of step 0" in text
    assert len(lab.history) == 0 and lab.next_phase() == "advantages" and controls.status.value == ""
    assert not controls.step_button.disabled
    click_step(controls)  # exactly one step, finished from where it stopped
    assert [r.step for r in lab.history] == [0] and controls.progress.value == 1
    controls.clear_button.click()
    assert log_text(controls) == "" and "grpo-lab-log" in controls.log.value
    controls._say("x" * 2000)  # long lines wrap inside the fixed-width box
    assert "pre-wrap" in controls.log.value and controls.log_box.layout.width == "100%"


def test_the_log_is_single_spaced_and_a_long_line_hangs_under_its_first_word(loaded_lab):
    """JupyterLab's HTML widget sets a 28 px line height (its row height), which double-spaced the 12 px log; each
    line is its own block, and a wrapped one's continuation is indented under it."""
    controls = StepControls(loaded_lab())
    controls._say("short\n" + "a long line " * 40)
    html = controls.log.value
    assert "line-height:1.35" in html and html.count("text-indent:-2em") == 2


def number_fields():
    """Every int and float field of the config: (section, name, JSON-schema type)."""
    from grpo_lab.config.schema import LabConfig

    schema = LabConfig.model_json_schema()
    defs = schema["$defs"]
    out = []
    for section, prop in schema["properties"].items():
        for name, field in defs[prop["$ref"].split("/")[-1]]["properties"].items():
            if field.get("type") in ("integer", "number") and "enum" not in field:
                out.append((section, name, field["type"]))
    return out


def test_every_number_field_refuses_a_non_number_and_an_int_field_a_fraction_with_the_config_unchanged(tiny_config):
    """Issue 40: ipywidgets' IntText turned '2.5' into 25 (the config took it) and swallowed 'abc' without a word. Each
    int and float field is typed as text and parsed by the config's validation: a refusal is one line under the field
    naming it, what was typed stays in view, and the config keeps its value."""
    fields = number_fields()
    assert len(fields) >= 20 and {t for *_, t in fields} == {"integer", "number"}
    editor = ConfigEditor(Lab(tiny_config()).config)
    before = editor.config.to_dict()
    for section, name, kind in fields:
        widget, error = editor.inputs[(section, name)][0], editor.errors[(section, name)]
        for typed in ["abc", "2.5"] if kind == "integer" else ["abc", "1.2.3"]:
            widget.value = typed
            assert editor.config.to_dict() == before, (section, name, typed)
            assert error.reason and error.reason.startswith(f"{section}.{name}: got {typed!r}"), (typed, error.reason)
            assert "\n" not in error.reason and widget.value == typed
            error.widget.children[1].click()  # revert
            assert widget.value == as_text_of(before[section][name])


def as_text_of(value):
    from grpo_lab.ui.editor import as_text

    return as_text(value)


def test_number_text_is_read_as_the_configs_validation_reads_it(tiny_config):
    """' 4 ' and '4.0' into an int field are 4, '1e-4' into a float field is 0.0001 (pydantic's own parsing); the field
    then shows the config's value."""
    editor = ConfigEditor(Lab(tiny_config()).config)
    gens, _ = editor.inputs[("grpo", "num_generations")]
    for typed in (" 4 ", "4.0"):
        gens.value = "6"
        gens.value = typed
        assert editor.config.grpo.num_generations == 4 and editor.errors[("grpo", "num_generations")].reason is None
    lr, _ = editor.inputs[("grpo", "learning_rate")]
    lr.value = "1e-4"
    assert editor.config.grpo.learning_rate == 1e-4 and lr.value == "0.0001"


def test_the_panels_step_count_refuses_what_is_not_a_whole_number(loaded_lab):
    """The panel's 'steps' box is text too: '2.5' once ran 25 steps."""
    controls = StepControls(loaded_lab())
    for typed in ("2.5", "abc", "0", ""):
        controls.count.value = typed
        controls.run_button.click()
        assert controls.thread is None, typed  # nothing started
        assert f"error: steps: {typed!r} is not a whole number" in controls.log_text().splitlines()[-1]
