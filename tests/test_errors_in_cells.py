"""A LabError raised in a notebook cell shows as its one line, not a traceback (issue 34, item 6); `%tb` still prints
the whole traceback; any other error keeps IPython's usual traceback. Run in a real IPython shell, in-process."""

from __future__ import annotations

import pytest

pytest.importorskip("IPython")


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    from grpo_lab.errors import one_line_in_cells

    shell = InteractiveShell.instance()
    shell.InteractiveTB.set_colors("nocolor")  # plain text to compare
    assert one_line_in_cells(shell)
    yield shell
    shell.set_custom_exc((), None)


CELL = """
from grpo_lab import ConfigError
def deep():
    raise ConfigError("grpo.num_generations: got 1; give 2 or more (a group needs two completions)")
deep()
"""


def test_a_lab_error_in_a_cell_is_one_line_and_tb_shows_the_rest(shell, capsys):
    result = shell.run_cell(CELL)
    out = capsys.readouterr()
    shown = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert shown == [
        "ConfigError: grpo.num_generations: got 1; give 2 or more (a group needs two completions)   "
        "(%tb shows the traceback)"
    ]
    assert result.error_in_exec is not None  # the cell still failed (papermill stops there)
    shell.run_line_magic("tb", "")
    out = capsys.readouterr()
    assert "deep()" in out.out + out.err and "Traceback" in out.out + out.err


def test_other_errors_keep_their_traceback(shell, capsys):
    shell.run_cell("def deep():\n    raise ValueError('a bug')\ndeep()")
    out = capsys.readouterr()
    assert "deep()" in out.out + out.err and "ValueError: a bug" in out.out + out.err


def test_outside_ipython_nothing_is_installed(monkeypatch):
    import IPython

    from grpo_lab.errors import one_line_in_cells

    monkeypatch.setattr(IPython, "get_ipython", lambda: None)
    assert one_line_in_cells() is False


def test_importing_grpo_lab_changes_nothing_outside_the_package():
    """Issue 41: `import grpo_lab` installed an IPython exception handler and a bitsandbytes logging filter. Now a
    Lab made in the kernel installs the one-line errors (and `%load_ext grpo_lab`), and every 4-bit load (its
    quantization_config) the filter."""
    import subprocess
    import sys

    code = """
import logging
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
import grpo_lab
assert shell.custom_exceptions == (), ("import", shell.custom_exceptions)
assert not bnb.filters, ("import", bnb.filters)
lab = grpo_lab.Lab("tiny-cpu")
assert shell.custom_exceptions == (grpo_lab.LabError,), ("Lab", shell.custom_exceptions)
from grpo_lab.models.learner import quantization_config
assert lab.config.model.load_in_4bit and quantization_config(lab.config.model) is not None
assert bnb.filters, "4-bit load"
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.stdout.strip().endswith("ok"), run.stderr[-2000:]


def test_load_ext_installs_the_one_line_errors():
    from IPython.core.interactiveshell import InteractiveShell

    from grpo_lab import LabError

    shell = InteractiveShell.instance()
    shell.set_custom_exc((), None)
    try:
        shell.run_line_magic("load_ext", "grpo_lab")
        assert shell.custom_exceptions == (LabError,)
    finally:
        shell.set_custom_exc((), None)
