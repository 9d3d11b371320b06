"""User-facing errors: one line that names the field or value and the fix.

Everything a user can get wrong (config, devices, paths) is raised as a `LabError`;
the CLI prints it without a traceback and exits 2, a notebook shows it as one line.
"""

from __future__ import annotations

import sys


class LabError(Exception):
    """A problem the user can fix; the message is one line naming the field and the fix."""


class ConfigError(LabError):
    """An invalid config value, key or override."""


class NonFinite(LabError):
    """A non-finite loss, gradient norm or updated weight: the step is refused, never applied.
    The Lab fills in `step` (the phase functions do not know it)."""

    def __init__(self, phase: str, problem: str, fix: str):
        super().__init__(phase, problem, fix)
        self.phase, self.problem, self.fix, self.step = phase, problem, fix, None

    def __str__(self) -> str:
        at = "" if self.step is None else f" at step {self.step}"
        return f"{self.phase}: {self.problem}{at}; the step was refused and rolled back, nothing applied; {self.fix}"


def format_validation_error(err) -> str:
    """Turn a pydantic ValidationError into 'field.path: problem' lines (one per error)."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-"))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; remove it or check its spelling (see docs/config.md)"
        elif e["type"] == "literal_error":
            msg = f"got {e.get('input')!r}; {msg.lower()}"
        elif e["type"] == "string_too_short" and e.get("input") == "":
            msg = "empty; give a value, or null where the field has a null default"
        elif "input" in e and e["type"] not in ("missing", "value_error"):
            msg = f"got {e['input']!r}; {msg[:1].lower()}{msg[1:]}"  # one case for every refusal's reason
        lines.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(lines)


def ipython_shell():
    """The running IPython shell (a Jupyter or papermill kernel), or None outside one or without IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def one_line_in_cells(shell=None) -> bool:
    """In an IPython kernel (Jupyter, papermill), a LabError shows as its one line, not a traceback; `%tb` prints the
    whole traceback; and `!grpo-lab` finds the kernel's own CLI (cli_on_path). Returns whether it was installed (False
    outside IPython)."""
    shell = ipython_shell() if shell is None else shell
    if shell is None:
        return False

    def show(shell, etype, value, tb, tb_offset=None):
        # why: IPython's %tb prints sys.last_*, which its custom-exception path leaves unset
        sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb
        if hasattr(sys, "last_exc"):
            sys.last_exc = value
        # IPython leaves the showing to the handler: _showtraceback is what its kernel publishes as the cell's error
        shell._showtraceback(etype, value, [f"{etype.__name__}: {value}   (%tb shows the traceback)"])

    shell.set_custom_exc((LabError,), show)
    cli_on_path()
    return True


def cli_on_path(environ=None) -> bool:
    """Put this Python's scripts folder (a venv's bin/) first on PATH when `grpo-lab` is not found there, so that
    `!grpo-lab ...` in a cell runs the CLI of the kernel's own install. Why: a kernel started by `.venv/bin/jupyter`
    does not have `.venv/bin` on its PATH. Returns whether PATH changed."""
    import os
    import shutil
    from pathlib import Path

    environ = os.environ if environ is None else environ
    scripts = Path(sys.executable).parent
    if shutil.which("grpo-lab", path=environ.get("PATH")) or not (scripts / "grpo-lab").exists():
        return False
    environ["PATH"] = os.pathsep.join([str(scripts), *filter(None, [environ.get("PATH")])])
    return True
