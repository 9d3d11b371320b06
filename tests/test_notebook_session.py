"""A notebook session as a user has it (issue 40): the step line, the Lab's summary and a StepResult name each reward
function's mean; `lab.save_report()` writes the CLI's report.html, read in Chromium (a line per reward function, a key
of the phase colours on the timeline); `!grpo-lab` finds the kernel's own CLI whatever the kernel's PATH."""

from __future__ import annotations

import json
import sys

import pytest
from html_pages import needs_chromium, opened

REWARDS = ["exact_answer", "format", "length"]  # tiny_config's


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """Two steps of a Lab made as a notebook cell makes one (tiny_config's three reward functions)."""
    from conftest import tiny_dict

    from grpo_lab import Lab
    from grpo_lab.models.source import resolve_model_path

    lab = Lab(tiny_dict(resolve_model_path("builtin:tiny-random"), memory={"sample_hz": 50})).load()
    results = [lab.step(), lab.step()]
    yield lab, results, tmp_path_factory.mktemp("session")
    lab.close()


def test_each_reward_functions_mean_is_in_the_step_line_the_metrics_and_the_labs_summary(session):
    lab, results, _ = session
    last = results[-1]
    assert list(last.rewards) == REWARDS
    line = last.summary()
    for name in REWARDS:
        assert f"{name} {last.rewards[name]:.3f}" in line, line
        assert last.metrics()[f"rewards/{name}/mean"] == last.rewards[name]  # TRL's name
        assert f"rewards/{name}/mean" in lab._repr_html_()
    assert "reward/" + REWARDS[0] not in last.metrics()  # one name per fact


def test_a_step_result_shows_as_its_one_line(session):
    _, results, _ = session
    shown = repr(results[-1])
    assert "\n" not in shown and "'peak'" not in shown and shown.startswith("<StepResult step 1: reward"), shown


def test_a_run_from_before_trls_names_reads_back(session):
    from grpo_lab.algo.containers import StepResult

    _, results, _ = session
    record = results[-1].metrics()
    old = {k: v for k, v in record.items() if not k.startswith("rewards/")}
    old.update({f"reward/{name}": mean for name, mean in results[-1].rewards.items()})
    assert StepResult.from_metrics(old).rewards == StepResult.from_metrics(record).rewards == results[-1].rewards


@needs_chromium
def test_save_report_writes_the_clis_report_from_a_notebook_session(session):
    lab, results, folder = session
    path = lab.save_report(folder / "report.html")
    assert path.exists() and "grpo_lab notebook session" in path.read_text()
    with opened(path, "report/notebook-session.png", height=1400) as page:
        figures = page.evaluate(
            "[...document.querySelectorAll('.js-plotly-plot')].map(el => ({"
            "names: el.data.map(t => t.name), notes: (el.layout.annotations || []).map(a => a.name || a.text)}))"
        )
    timeline, training = figures[0], figures[-1]
    assert "phase-key" in timeline["notes"], timeline["notes"]  # the colours' legend, labelled bands or not
    for name in REWARDS:
        assert f"rewards/{name}/mean" in training["names"], training["names"]
    assert page_steps(path) == [r.step for r in results]


def page_steps(path) -> list[int]:
    """The steps the report's reward plot draws (read from the page's own figure JSON)."""
    text = path.read_text()
    start = text.index('"name":"reward"')
    x = text.rindex('"x":[', 0, start)
    return json.loads(text[x + 4 : text.index("]", x) + 1])


def test_the_kernels_own_cli_is_found_whatever_the_kernels_path():
    from pathlib import Path

    from grpo_lab.errors import cli_on_path

    scripts = Path(sys.executable).parent
    if not (scripts / "grpo-lab").exists():
        pytest.skip("grpo-lab is not installed beside this Python")
    environ = {"PATH": "/usr/bin:/bin"}  # a kernel started by .venv/bin/jupyter: no .venv/bin
    assert cli_on_path(environ) and environ["PATH"].split(":")[0] == str(scripts)
    assert not cli_on_path(environ)  # found now: PATH left as it is
    assert environ["PATH"].count(str(scripts)) == 1
