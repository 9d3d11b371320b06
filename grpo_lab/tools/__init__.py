"""Tools and the multi-turn tool loop, as TRL 1.16 spells them (`tools=`, `max_tool_calling_iterations`): a room of
its own below the Lab. `toolbox.py` holds the tools and calls them, `template.py` the chat template's side of a tool
call, `loop.py` the loop a generator's chunks are driven through."""

from __future__ import annotations

from typing import Callable, Optional

from ..errors import LabError


def check_tools_config(config) -> None:
    """Where tools cannot run yet, one line each: the vllm backend (its engine is not driven by the loop yet) and a
    sharded learner (its ranks sample their share of the rows in one turn)."""
    if config.generator.backend == "vllm":
        raise LabError("tools: generator.backend vllm does not run the tool loop yet; use generator.backend: hf")
    if config.placement.learner_procs > 1:
        raise LabError(
            f"tools: a sharded learner (placement.learner_procs {config.placement.learner_procs}) does not run the "
            "tool loop yet; use placement.learner_procs: 1"
        )


def toolbox_for(tools: Optional[list[Callable]], config):
    """The Lab's tools (None: none): each checked for a schema now, at construction, and the config for where they
    can run."""
    if not tools:
        return None
    from .toolbox import Toolbox

    check_tools_config(config)
    return Toolbox(list(tools))
