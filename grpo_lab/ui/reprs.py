"""How a step result shows in a notebook cell: a table of its figures (each reward function's mean beside the mean),
with tools a table of its tool calls, failures and turns, its per-phase memory folded under them, and a plain-text
line wrapped at words at 120 columns. StepResult lives in algo/, below the notebook's concerns: its HTML is registered
with IPython's formatters by name when a Lab is made in a kernel, so algo/ never learns about HTML."""

from __future__ import annotations

from ..errors import ipython_shell
from ..memory.tables import Column, MemoryTable, Table, tool_table, wrap_line

STEP_RESULT = ("grpo_lab.algo.containers", "StepResult")  # the type IPython formats, by module and name


def step_table(result) -> Table:
    """One row: the step's reward (mean ± std, each function's mean), loss, KL, grad norm, completion length and
    seconds."""
    each = result.rewards if len(result.rewards) > 1 else {}
    columns = [Column("step", numeric=True), Column("reward", numeric=True)]
    columns += [Column(name, numeric=True) for name in each]
    # why "completion len": a reward function named length (tiny-cpu's) had a column of the same name beside it
    columns += [Column(name, numeric=True) for name in ("loss", "kl", "grad norm", "completion len", "seconds")]
    row = [str(result.step), f"{result.reward_mean:.3f} ± {result.reward_std:.3f}"]
    row += [f"{mean:.3f}" for mean in each.values()]
    kl = "-" if result.kl is None else f"{result.kl:.4f}"
    row += [f"{result.loss:+.4f}", kl, f"{result.grad_norm:.3f}", f"{result.completion_length_mean:.1f}"]
    row += [f"{result.step_seconds:.2f}"]
    return Table(columns, [row])


def step_html(result) -> str:
    memory = MemoryTable(result.memory, result.step)._repr_html_() if result.memory else ""
    folded = (
        f"<details><summary>memory per phase ({len(result.memory)} rows, MiB); .metrics(): every field</summary>"
        f"{memory}</details>"
        if memory
        else ""
    )
    # why a table of its own: as four more columns of the step's table, a tool step's table was 1,063 px in 848
    tools = tool_table([result])
    tools = "" if tools is None else tools.html()
    return f"<div class='grpo-lab-step'>{step_table(result).html()}{tools}{folded}</div>"


def step_text(result, printer, cycle) -> None:
    printer.text(wrap_line(repr(result)))


def step_results_as_tables(shell=None) -> bool:
    """In an IPython kernel: a StepResult ending a cell shows as step_html (and its text wrapped at 120 columns).
    Returns whether it was registered (False outside IPython); idempotent."""
    shell = ipython_shell() if shell is None else shell
    if shell is None:
        return False
    formatters = shell.display_formatter.formatters
    formatters["text/html"].for_type_by_name(*STEP_RESULT, step_html)
    formatters["text/plain"].for_type_by_name(*STEP_RESULT, step_text)
    return True
