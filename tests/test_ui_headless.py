"""What the notebook widgets leave in a saved notebook (issue 51): in a headless run (papermill, nbconvert) no widget
is made, a line says so; live, the plot's text form is one line and the panel's step count is run.steps."""

import ipywidgets
import pytest

from grpo_lab.runtime import LIVE_ENV, frontend_is_live
from grpo_lab.ui import Panel
from grpo_lab.ui.live import LivePlot, NotLive


class Kernel:
    """A kernel whose current cell came with `allow_stdin` as a frontend sends it (nbclient: False)."""

    def __init__(self, allow_stdin: bool):
        self.request = {"header": {"msg_type": "execute_request"}, "content": {"allow_stdin": allow_stdin}}

    def get_parent(self, channel=None):
        return self.request


@pytest.fixture
def cell_from(monkeypatch):
    """Run the test's calls as a cell sent with allow_stdin on (a person's frontend) or off (papermill)."""
    monkeypatch.delenv(LIVE_ENV, raising=False)

    def sent(allow_stdin: bool):
        shell = type("Shell", (), {"kernel": Kernel(allow_stdin)})()
        monkeypatch.setattr("IPython.get_ipython", lambda: shell)

    return sent


def test_a_headless_run_makes_no_widget_and_says_so_in_a_line(loaded_lab, cell_from, monkeypatch):
    lab = loaded_lab()
    try:
        cell_from(allow_stdin=False)
        before = len(ipywidgets.Widget.widgets)
        plot, panel = lab.memory_plot(), lab.ui()
        assert isinstance(plot, NotLive) and isinstance(panel, NotLive) and not lab._plots
        assert len(ipywidgets.Widget.widgets) == before  # nothing a saved notebook's widget state would keep
        for shown in (plot._repr_mimebundle_(), panel._repr_mimebundle_()):
            assert set(shown) == {"text/plain", "text/html"} and len(shown["text/plain"]) < 300
            assert "papermill" in shown["text/plain"] and "lab.memory_snapshot()" in shown["text/plain"]
        monkeypatch.setenv(LIVE_ENV, "1")  # e.g. Voila: widgets drawn, cells sent without stdin
        assert isinstance(lab.memory_plot(), LivePlot)
        monkeypatch.delenv(LIVE_ENV)
        cell_from(allow_stdin=True)  # a person's frontend: JupyterLab, Notebook, VS Code
        assert isinstance(lab.ui(), Panel) and isinstance(lab.ui().plot, LivePlot)
        monkeypatch.setenv(LIVE_ENV, "0")
        assert not frontend_is_live()
    finally:
        lab.close()


def test_outside_a_kernel_the_widgets_are_made(monkeypatch):
    monkeypatch.delenv(LIVE_ENV, raising=False)
    monkeypatch.setattr("IPython.get_ipython", lambda: None)
    assert frontend_is_live()


def test_the_live_plots_text_is_one_line_and_its_toolbar_is_clear_of_the_title(loaded_lab):
    lab = loaded_lab()
    try:
        lab.step()
        plot = lab.memory_plot()
        bundle = plot.mimebundle()
        assert "application/vnd.jupyter.widget-view+json" in bundle
        assert bundle["text/plain"] == "FigureWidget: Live memory (MiB), drawn live"
        # the toolbar stands upright in the right margin: a replaced plot's long title runs under it no more
        assert plot.fig.layout.modebar.orientation == "v" and plot.fig.layout.margin.r >= 40
    finally:
        lab.close()


def test_the_panels_step_count_is_run_steps_and_follows_it_but_never_over_a_typed_count(loaded_lab):
    """Issue 51: the notebook's steps (2), the editor's run.steps (15) and the panel's box (5) were three numbers."""
    lab = loaded_lab(run={"steps": 3})
    try:
        panel = lab.ui()
        count, run_steps = panel.controls.count, panel.editor.inputs[("run", "steps")][0]
        assert count.value == run_steps.value == "3"
        run_steps.value = "4"  # an edit in the panel's editor
        assert lab.config.run.steps == 4 and count.value == "4"
        lab.config.run.steps = 6  # an edit in a cell: the box takes it when next read
        assert panel.controls.steps() == 6 and count.value == "6"
        count.value = "7"  # the user types a count: it stays, whatever run.steps becomes
        run_steps.value = "5"
        assert count.value == "7" and panel.controls.steps() == 7 and lab.config.run.steps == 5
    finally:
        lab.close()


@pytest.mark.parametrize("allow_stdin", [True, False], ids=["person", "papermill"])
def test_a_headless_load_shows_no_loading_bar_and_a_person_s_does(allow_stdin, cell_from):
    """transformers' loading bars are off only while a headless run loads (they save as a frozen 0 %), and on after."""
    from transformers.utils import logging as hf_logging

    from grpo_lab.ui.quiet import no_frozen_bars

    cell_from(allow_stdin)
    hf_logging.enable_progress_bar()
    with no_frozen_bars():
        assert hf_logging.is_progress_bar_enabled() == allow_stdin
    assert hf_logging.is_progress_bar_enabled()


@pytest.mark.parametrize("allow_stdin", [True, False], ids=["person", "papermill"])
def test_a_story_keeps_the_named_library_notices_out_and_others_in(allow_stdin, cell_from):
    """TRL's vLLM-version warning and vLLM's Triton notice are dropped once a story quiets the libraries; another
    warning from the same place still shows; the loading bars go only in a headless run."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging
    from trl.import_utils import is_vllm_available

    from grpo_lab.ui.quiet import VLLM_TRITON, quiet_libraries

    cell_from(allow_stdin)
    hf_logging.enable_progress_bar()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        is_vllm_available()
        assert any("TRL currently supports vLLM" in str(w.message) for w in seen)  # vLLM 0.32 here: TRL warns
        seen.clear()
        quiet_libraries()
        is_vllm_available()
        warnings.warn("another warning", UserWarning, stacklevel=1)
        assert [str(w.message) for w in seen] == ["another warning"]
    logger = logging.getLogger("vllm.triton_utils.importing")
    record = lambda msg: logging.LogRecord(logger.name, logging.WARNING, __file__, 1, msg, None, None)
    assert not logger.filter(record(f"{VLLM_TRITON}. Disabling Triton.")) and logger.filter(record("other"))
    assert hf_logging.is_progress_bar_enabled() == allow_stdin  # a headless story's bars: off for the notebook
    hf_logging.enable_progress_bar()  # as this worker's later tests expect


@pytest.mark.parametrize("allow_stdin", [True, False], ids=["person", "papermill"])
def test_a_built_in_model_built_in_a_headless_run_prints_a_line_not_a_bar(allow_stdin, cell_from, capsys):
    """A fresh cache's first notebook builds the built-in model: headless, its bar would be saved as a frozen "0%"
    (a fresh clone's notebooks 03 and 04 saved one), so it is one printed line there, a bar for a person."""
    from grpo_lab.models.tiny_train import build_progress

    cell_from(allow_stdin)
    bar = build_progress("building kv-heavy-v1 (once; later loads read it)", 0)
    bar.update(1)
    assert bar.disable == (not allow_stdin)  # (before close, which sets it)
    bar.close()
    printed = capsys.readouterr().out
    assert printed == ("" if allow_stdin else "building kv-heavy-v1 (once; later loads read it)\n")
