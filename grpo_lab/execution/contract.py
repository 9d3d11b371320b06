"""The executor contract: where a Lab's phases run. The Lab keeps the config, the step lifecycle, history, the
timeline and the views; its executor holds the models and does each phase's work. Two implement it:
`execution/local.py` (this process's models; also inside each rank of a sharded learner) and `sharded/driver.py`
(a sharded learner's driver, which sends each phase to its Ray ranks). An executor is given what it needs (the
config, the reward functions, the step index) and never the Lab. EXECUTORS names them by import path, so the
one-process path never imports the Ray driver.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable, ContextManager, Optional, Protocol, runtime_checkable

from ..runtime import runtime

EXECUTORS: dict[str, str] = {
    "local": "grpo_lab.execution.local:LocalExecutor",
    "ranks": "grpo_lab.execution.sharded.driver:RankExecutor",
}
# an executor's tools made from the Lab's `tools` and `environment_factory`, by the process it runs in: a rank of a
# sharded learner is given the driver's description of them (execution/sharded/driven.py: the driver runs them),
# any other process TRL's tools, checked at construction into tools.Tools
TOOLS: dict[str, str] = {
    "rank": "grpo_lab.execution.sharded.driven:rank_tools",
    "process": "grpo_lab.tools:tools_for",
}


class Sharding(Protocol):
    """What the algorithm (algo/grpo.py, algo/logprobs.py) and the generator (generation/hf.py) ask of a learner that
    may be sharded, so that neither imports an executor or FSDP: an executor hands its `sharding` to the learner it
    loads (Learner.sharding). models/fsdp.FSDP implements it over FSDP2 (the identity on a model no rank shares)."""

    def agreed(self, *models) -> ContextManager[None]:
        """A pass over `models` that, when it raises on any rank, raises on every rank there, their state reset."""

    def full(self, t): ...  # `t` whole on every rank (a collective; a plain tensor as it is)
    def local(self, t): ...  # this rank's shard of `t` (a plain tensor as it is)
    def generation(self, model, gather: bool) -> ContextManager[None]:
        """`model` set up for a rollout (eval mode; sharded: gathered whole, or a layer per forward), put back after."""


@runtime_checkable
class Executor(Protocol):
    """What the Lab (and a loaded Lab's edit guard, config/edits.py) asks of an executor."""

    name: str
    config: object  # the Lab's LabConfig (one object for the Lab's life: edits change it in place)
    reward_funcs: list[Callable]  # resolved; config/edits.py replaces them when data.rewards changes
    rewards_given: bool  # passed to Lab(reward_funcs=...) rather than named in data.rewards
    reward_models: list[Callable]  # data.reward_models' scorers, called after reward_funcs (built at load)
    learner: object  # None until loaded (a driver: its ranks)
    generator: object
    reference: object
    prompts: object  # data.prompts.PromptSource (a rank's: HandedPrompts, the rows its driver draws)
    train_dataset: object  # the Lab's own dataset object (None: data.dataset names one)
    opened: object  # the dataset preflight opened and checked (data.sources.Opened), taken by the next build_prompts
    reference_strategy: Optional[str]
    on_cuda: bool  # the phases compute on a GPU here (they then get NVTX ranges too)
    sharding: Sharding  # handed to the learner it loads: how the algorithm's passes run over it

    @property
    def loaded(self) -> bool: ...

    # memory: what this process watches
    def devices(self) -> list[str]: ...
    def memory_watch(self) -> list[str]: ...
    def memory_sampler(self): ...
    def listeners(self) -> list: ...

    # load and release; edits after load
    def load(self, memory) -> None: ...
    def release(self) -> None: ...
    def check_live(self, config) -> None: ...
    def build_reference(self) -> None: ...
    def build_prompts(self) -> None: ...
    def build_reward_models(self) -> None: ...

    # the step (`state`: lifecycle.StepState)
    def check_learner(self) -> None: ...
    def compute(self, name: str, state, *inputs): ...
    def before_command(self) -> bool: ...
    def failed(self, phase: str, err: Optional[BaseException]) -> Optional[str]: ...
    def rollback(self, state) -> None: ...
    def result(self, state, seconds: dict): ...

    # state in and out, and failures on demand
    def inspect(self) -> list[dict]: ...
    def arm_fault(self, rank: int, phase: str, error: str) -> None: ...
    def save_adapter(self, path) -> Path: ...
    def save_checkpoint(self, path) -> Path: ...
    def restore_checkpoint(self, checkpoint) -> None: ...


def executor_for(
    config,
    reward_funcs: Optional[list],
    step_index: Callable[[], int],
    train_dataset=None,
    tools=None,
    environment_factory=None,
) -> Executor:
    """The executor a config asks for: its ranks' driver when placement.learner_procs > 1 (in the driver; a rank runs
    its phases locally). `reward_funcs`, `train_dataset`: as passed to the Lab (None: data.rewards and data.dataset
    name them); `tools`, `environment_factory`: TRL's, checked here (at construction) into tools.Tools, which only
    the local executor runs (tools/ refuses the rest); on a rank, `tools` is its driver's description (TOOLS)."""
    name = "ranks" if config.placement.learner_procs > 1 and runtime().is_driver else "local"
    checked = imported(TOOLS["rank" if runtime().is_rank else "process"])(tools, environment_factory, config)
    given = {"tools": checked} if checked is not None else {}
    return imported(EXECUTORS[name])(config, reward_funcs, step_index, train_dataset, **given)


def imported(path: str):
    """The object a registry names as "module:attribute"."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
