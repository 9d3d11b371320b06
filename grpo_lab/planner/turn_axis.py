"""The fit frontier's turns axis (`grpo-lab plan --frontier --turns 1,2,4`): one frontier per number of turns a tool
loop may make, each planned with generator.max_tool_calling_iterations = turns - 1 (planner/turns.py plans the
rollout at its worst turn), on one page. Only a config with tools (generator.tools or environment_factory) has turns;
bad input is one LabError naming --turns."""

from __future__ import annotations

import html
from dataclasses import replace
from pathlib import Path
from typing import Union

from ..errors import LabError
from .grid import _values


def turns_values(config, given) -> list[int]:
    """`given` (a range string or list of turns, each 1 or more) checked against the config: refused without tools."""
    from .turns import uses_tools

    values = _values(given, "--turns", [config.generator.max_tool_calling_iterations + 1])
    if not uses_tools(config):
        raise LabError(
            "--turns: this config calls no tools, so its rollout has one turn; set generator.tools (e.g. --set "
            "generator.tools=[my_tools:add]) or drop --turns"
        )
    return values


def frontiers_by_turns(config, lengths=None, generations=None, micro_batches=None, turns=None) -> list:
    """One Frontier per value of `turns` (a range string like "1,2,4" or a list), each its config with
    generator.max_tool_calling_iterations = turns - 1."""
    from ..config.loading import load_config
    from .frontier import frontier

    config = load_config(config)
    fronts = []
    for t in turns_values(config, turns):
        front = frontier(load_config(config, [f"generator.max_tool_calling_iterations={t - 1}"]), lengths, generations,
                         micro_batches)  # fmt: skip
        fronts.append(replace(front, turns=t))
    return fronts


def pages(fronts: list) -> str:
    """One self-contained page of every frontier (plotly.js inlined once), each its heatmaps and its table."""
    parts = []
    for k, front in enumerate(fronts):
        body = front.figure().to_html(include_plotlyjs=k == 0, full_html=False)  # why once: the page stays offline
        parts.append(f"<h2>{front.turns} turns</h2>{body}<pre class='frontier-table'>{html.escape(str(front))}</pre>")
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>grpo_lab fit frontier by turns</title></head>"
        f"<body style='font-family:sans-serif'>{''.join(parts)}</body></html>"
    )


def write_pages(fronts: list, path: Union[str, Path], what: str = "--out") -> Path:
    """The page of every frontier, written atomically (as Frontier.to_html)."""
    from ..checks.paths import check_output_dir
    from ..files import atomic_write_text

    path = Path(path).absolute()
    if path.is_dir():
        raise LabError(f"{what}: {str(path)!r} is a directory; give the path of the HTML file to write")
    check_output_dir(path.parent, what)
    return atomic_write_text(path, pages(fronts))
