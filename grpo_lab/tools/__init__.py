"""Tools and the multi-turn tool loop, as TRL 1.16 spells them (`tools=`, `max_tool_calling_iterations`): a room of
its own below the Lab. `toolbox.py` holds the tools and calls them, `template.py` the chat template's side of a tool
call, `loop.py` the loop a generator's chunks are driven through."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import LabError


def check_tools_config(config) -> None:
    """Where tools cannot run yet, one line: a sharded learner with another backend than hf (its ranks decode the
    turns on their hf generators, each its share of the rows: generation/sample_once.py; its driver runs the tools)."""
    if config.placement.learner_procs > 1 and config.generator.backend != "hf":
        raise LabError(
            f"tools: a sharded learner (placement.learner_procs {config.placement.learner_procs}) decodes the tool "
            f"loop's turns on its ranks' hf generators, not generator.backend {config.generator.backend}; use "
            "generator.backend: hf"
        )


@dataclass
class Tools:
    """A Lab's tools and environments, checked at construction: what its executor hands the generator's tool loop."""

    toolbox: Optional[object]  # toolbox.Toolbox of the `tools=` functions (None: none)
    environments: Optional[object]  # environments.Environments of environment_factory (None: none)

    @property
    def reward_funcs(self) -> list[Callable]:
        """The environments' get_reward sources (TRL's extra reward functions, weight 1)."""
        return self.environments.reward_funcs if self.environments is not None else []

    @property
    def schemas(self) -> list[dict]:
        """The JSON schemas a prompt renders: the tools', then each environment class's methods (with a dict of
        environments, all of theirs: the longest a row's prompt can be, what the plan holds)."""
        found = list(self.toolbox.schemas) if self.toolbox is not None else []
        for pool in self.environments.pools.values() if self.environments is not None else []:
            found += [s for s in self.environments.toolbox(pool[0]).schemas if s not in found]
        return found

    def loop(self, tokenizer, eos_token_ids: list[int], config):
        from .loop import ToolLoop

        return ToolLoop(self.toolbox, tokenizer, eos_token_ids, config, self.environments)


def imported(spec: str, field: str):
    """A 'module:name' the config names, imported; one line when it cannot be."""
    module, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise LabError(f"{field}: cannot import {spec!r} ({err}); check the module path and the name") from None


def named_schemas(config) -> Optional[list[dict]]:
    """The schemas of the tools and environment the config names (generator.tools, generator.environment_factory),
    for a plan made without a Lab; None: none."""
    from .environments import Environments
    from .toolbox import Toolbox

    gen = config.generator
    tools = [imported(s, "generator.tools") for s in gen.tools]
    factory = gen.environment_factory
    environments = Environments(imported(factory, "generator.environment_factory"), tools) if factory else None
    if not tools and environments is None:
        return None
    return Tools(Toolbox(tools) if tools else None, environments).schemas


def tools_for(tools: Optional[list[Callable]], environment_factory, config) -> Optional[Tools]:
    """The Lab's tools and environments (None: neither; the config's generator.tools and environment_factory when
    the Lab is given none), each checked now, at construction (a schema for every tool
    and environment method, a reset on every environment), and the config for where they can run."""
    gen = config.generator
    tools = tools if tools is not None else [imported(s, "generator.tools") for s in gen.tools]
    if environment_factory is None and gen.environment_factory is not None:
        environment_factory = imported(gen.environment_factory, "generator.environment_factory")
    if not tools and environment_factory is None:
        return None
    from .environments import Environments
    from .toolbox import Toolbox

    check_tools_config(config)
    environments = Environments(environment_factory, list(tools or [])) if environment_factory is not None else None
    return Tools(Toolbox(list(tools)) if tools else None, environments)
