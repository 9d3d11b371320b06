"""`RankExecutor`: a Lab's phases over a sharded learner's ranks (placement.learner_procs > 1). The Lab keeps its API
and lifecycle (phase methods, `step()`, config edits, history, memory views); each phase is one command to every
rank (sharded/ranks.py: a Ray actor each), whose own Lab runs it on its shard (grpo_lab/rank.py). Every rank computes
the same rollout, rewards and advantages; log-probs and backward are each rank's rows, gathered; results come back from
rank 0, and every rank's samples and per-phase rows join the driver's memory sampler under 'rank<k>/<device>'.

The data is the driver's: it opens the dataset once (data.* or the Lab's train_dataset object), draws each step's
rows from its prompt source and hands them to every rank with the rollout; no rank opens the dataset. Its position
goes into checkpoints (rank 0 writes it) and goes back to the step's start when the ranks lose the step.

A phase that fails on any rank fails on every rank at the same point (runtime.agree), and each undoes its share as
one process would. A rank that cannot take part in that decision (killed, or blocked in a collective) gets every
rank stopped and started again from its boundary state, the one it wrote when the step began, so the LoRA weights
and AdamW state are bit for bit those before the step, and the step runs again from its rollout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from ...algo.containers import BackwardResult
from ...errors import LabError
from ...models.fsdp import FSDP
from ...models.source import fetch_once
from ...recovery.rollback import SnapshotsOnRanks
from .ranks import RankFailure, RankMemory, Ranks


class RankAdapter:
    """The sharded learner as the driver's vLLM generator sees a learner: its tokenizer, its LoRA parameters' sizes
    and `model.save_pretrained(path)`, which gathers the LoRA tensors from every rank (never the base) into a PEFT
    adapter that the engine loads."""

    def __init__(self, executor: "RankExecutor"):
        from ...models.learner import load_tokenizer
        from ...models.source import resolve_model_path

        self.executor, self.model = executor, self
        self.tokenizer = load_tokenizer(resolve_model_path(executor.config.model.name_or_path))

    def trainable_parameters(self) -> dict:
        import torch

        shapes = self.executor.ranks.call("lora_shapes", describe="lora_shapes")
        return {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shapes.items()}

    def save_pretrained(self, path) -> None:
        self.executor.ranks.call("save_adapter", str(path), describe="the generator's LoRA sync")


class RankExecutor:
    """The phases on `placement.learner_procs` ranks (see the module docstring)."""

    name = "ranks"
    reference = None  # each rank holds its own
    on_cuda = False  # the driver computes nothing; each rank marks its own phases
    sharding = FSDP()  # what each rank's LocalExecutor hands its learner (the driver runs no pass itself)

    def __init__(
        self, config, reward_funcs: Optional[list], step_index: Callable[[], int], train_dataset=None, tools=None
    ):
        from ...algo.rewards import reward_functions
        from .driven import DriverTools

        self.config = config
        self.tools = tools  # the Lab's tools (tools.Tools), here only: this process runs every call (sharded/driven.py)
        self.driven = DriverTools(tools) if tools is not None else None  # each rollout's rows' environments
        self.rewards_given = reward_funcs is not None  # refused at load: a rank cannot take this process's functions
        self.train_dataset = train_dataset  # the Lab's own dataset object (None: data.dataset names one), read here
        self.opened = None  # the dataset preflight opened and checked, which the next build_prompts takes
        self.prompts = None  # the run's prompt source, in this process: every step's rows are drawn here (draw)
        self.tokenizer = None  # the model's, with model.chat_template: the prompts are formatted here, once
        self.step_start: Optional[tuple[int, dict]] = None  # (step, the source's position as its first rows were drawn)
        self.reward_funcs = reward_functions(reward_funcs, config)
        self.reward_models: list = []  # data.reward_models, in this process: the driver scores, the ranks are told
        self.step_index = step_index
        self.ranks: Optional[Ranks] = None
        self.generator = None  # the ranks' one vLLM engine, in this process (sharded/remote.py), if any
        self.generator_behind = False
        self.adapter = None  # the ranks' LoRA as the engine syncs it (RankAdapter)
        self.lost = False  # the ranks were stopped or restarted: they are (or start) at the step's start
        self.sync_result = None  # rank 0's result of the step's sync
        self.model_path = config.model.name_or_path  # where the ranks load it from (fetch_once)

    @property
    def loaded(self) -> bool:
        return self.ranks is not None

    @property
    def learner(self):
        return self.ranks  # why: "loaded" means the ranks are up; each holds its shard of the learner

    @property
    def reference_strategy(self) -> str:
        return self.config.reference_strategy

    @property
    def own_engine(self) -> bool:
        """A generator with weights of its own (vLLM) runs in this process, for every rank (sharded/remote.py)."""

        return self.config.generator.own_weights

    # --- memory ---
    def devices(self) -> list[str]:
        """Each rank's device as the rank names it (a rank on a GPU Ray gave it sees it as its cuda:0)."""
        from ...runtime import Runtime

        place = self.config.placement
        size, learner = place.learner_procs, place.learner
        return [f"rank{k}/{Runtime(k, size, is_rank=True, own_gpu=True).device_of(learner)}" for k in range(size)]

    def memory_watch(self) -> list[str]:
        return [self.config.placement.learner]

    def memory_sampler(self):
        config = self.config
        engine_gpus = [d for d in config.placement.generator_devices() if d != "cpu"] if self.own_engine else []
        scorer = [config.placement.reward_model_device()] if config.data.reward_models else []
        # the driver's own host (its guard is the run's one host guard), its engine's and reward models' GPUs; the
        # ranks' arrive
        watched = list(dict.fromkeys(["cpu", *engine_gpus, *scorer]))
        return RankMemory(watched, config.memory.sample_hz, config.memory.host_threshold)

    def listeners(self) -> list:
        return []  # each rank writes its own allocator snapshots (runtime.snapshot_dir)

    # --- load and release ---
    def load(self, memory) -> None:
        from ..local import attach_engine, start_generator

        config = self.config
        if self.rewards_given:
            raise LabError(
                "reward_funcs: a sharded Lab's ranks are processes of their own and cannot take functions "
                "from this one; name them in data.rewards ('module:function')"
            )
        self.model_path = fetch_once(config.model.name_or_path, local=config.placement.ray_address is None)
        self.tokenizer = prompt_tokenizer(self.model_path, config)
        if self.tools is not None:  # why here: the template's one line before any rank starts (each checks it again)
            from ...tools import check_tools_config
            from ...tools.template import prepare_for_tools

            check_tools_config(config)
            prepare_for_tools(self.tokenizer)
        self.build_prompts()
        self.build_reward_models()
        self.ranks = Ranks(
            self.rank_config(),
            config.placement.learner_procs,
            memory,
            step=self.step_index,
            stopped=self.on_ranks_stopped,
            tools=self.driven.description() if self.driven is not None else None,
        ).start()
        self.ranks.answers.tools = self.driven  # (what the ranks' tool loops ask: their rows, their calls)
        if self.own_engine:  # the ranks' one engine, here: it starts with their adapter, gathered
            try:
                self.adapter = RankAdapter(self)
                self.generator = start_generator(config, self.adapter)
                attach_engine(memory, self.generator)
            except BaseException:
                self.ranks.close()
                raise
            self.ranks.answers.service = self.generator

    def build_reward_models(self) -> None:
        """data.reward_models in this process, on placement.reward_model (at load, and when they change): the driver
        scores each rollout once and hands the ranks the scores."""
        from ...models.reward_model import load_reward_model

        device = self.config.placement.reward_model_device()
        for model in self.reward_models:
            model.release()  # why first: the old models go before the new ones load
        self.reward_models = []
        self.reward_models = [load_reward_model(name, self.config, device) for name in self.config.data.reward_models]

    def release(self) -> None:
        if self.generator is not None:
            self.generator.close()
        if self.ranks is not None:
            self.ranks.close()
        for model in self.reward_models:
            model.release()
        self.ranks = self.generator = self.prompts = None
        self.reward_models = []

    # --- edits: refused here as in one process; applied on every rank at its next command ---
    def check_live(self, config) -> None:
        from ..reward_inputs import check_new_reward_models

        if self.generator is not None:
            self.generator.check_live(config)  # the driver's engine (the ranks' hf generators take every live edit)
        check_new_reward_models(self.config, config)

    def build_reference(self) -> None:
        """Nothing here: each rank builds its own reference from the config it is sent with its next command."""

    def build_prompts(self) -> None:
        """The prompt source of data.* or of the Lab's train_dataset, in this process only (at load, and when a data
        field changes): the dataset is opened once, whatever the number of ranks; each rank is handed its rows."""
        from ...data.prompts import prompt_source

        opened, self.opened = self.opened, None
        tools = self.tools.schemas if self.tools is not None else None  # the ranks render the same (tools/loop.py)
        self.prompts = prompt_source(self.config, self.tokenizer, self.train_dataset, opened, tools=tools)
        self.step_start = None  # (a position in the old source means nothing in the new one)

    def draw(self) -> tuple:
        """This step's prompt rows for every rank, and the epoch they reach (TRL's trainer_state.epoch). The source's
        position before the step's first rows is kept: a step the ranks lose starts again from it (take_lost)."""
        step = self.step_index()
        if self.step_start is None or self.step_start[0] != step:
            self.step_start = (step, self.prompts.state_dict())
        return self.prompts.next_batch(self.config.grpo.prompts_per_step), self.prompts.epoch

    # --- the step ---
    def check_learner(self) -> None:
        pass  # each rank's learner is checked by its own Lab, on its own device

    def compute(self, name: str, state, *inputs):
        """Every rank runs the phase with its own inputs (the same as these: every rank holds the whole rollout, sampled
        once, generation/sample_once.py)."""
        if self.generator is not None and (name == "sync" or (name == "rollout" and self.generator_behind)):
            self.generator.sync(self.adapter)  # the engine's LoRA from the ranks, before they end the step
            self.generator_behind = False
        scores = self.score(*inputs) if name == "rewards" and self.reward_models else None
        drawn = self.draw() if name == "rollout" else None
        given = self.driven.for_rewards(*inputs) if name == "rewards" and self.driven is not None else None
        out = self.ranks.call("phase", name, self.rank_config(), scores, drawn, given, describe=name)
        if name == "rollout" and self.driven is not None:
            self.driven.finish(out)  # (the rollout's environments are this process's)
        if name == "optimizer" and state.snapshot is None:
            state.snapshot = SnapshotsOnRanks()  # why: each rank took its own rollback snapshot
        if name == "sync":
            self.sync_result = out
        if name == "backward":  # each rank keeps the old log-probs its first backward recorded; the driver, the stats
            return BackwardResult(out, None, None)
        return out

    def score(self, rollout) -> list[tuple[str, list[float]]]:
        """The reward models' scores of `rollout` (rank 0's, which every rank holds), called with the inputs every
        reward gets: (name, scores) each, for the ranks' rewards phase."""
        from ...algo.grpo import rewards

        table = rewards(rollout, self.reward_models).per_function  # [N, models]
        return [(model.__name__, table[:, j].tolist()) for j, model in enumerate(self.reward_models)]

    def rank_config(self) -> dict:
        """The config as the ranks run it: the model where the driver fetched it, no reporting (the driver reports)."""
        config = self.config.to_dict()
        config["run"]["report_to"] = []
        config["model"]["name_or_path"] = self.model_path
        return config

    def on_ranks_stopped(self) -> None:
        """Ranks calls this when it stopped or restarted the ranks."""
        self.lost = True

    def back_to_step_start(self) -> None:
        """The data source back where this step first drew (nothing, if this step drew nothing yet)."""
        if self.step_start is not None and self.step_start[0] == self.step_index():
            self.prompts.load_state_dict(self.step_start[1])

    def take_lost(self) -> bool:
        """Whether the ranks lost the step's progress since the last look (the engine then may hold an adapter they
        undid)."""
        lost, self.lost = self.lost, False
        if lost:
            self.generator_behind = self.generator is not None
            self.back_to_step_start()  # why: the step runs again on its own rows
        return lost

    def before_command(self) -> bool:
        lost = self.take_lost()  # e.g. an interrupted lab.inspect(): the next command starts from the step
        self.ranks.up()
        return lost

    def failed(self, phase: str, err: Optional[BaseException]) -> Optional[str]:
        """None when every rank undid its own share (the Lab's default undo follows); else the ranks were stopped,
        and the Lab's step goes back to its start (the Lab does so on any answer but None)."""
        self.generator_behind |= phase == "sync" and self.generator is not None  # the engine may hold an undone adapter
        if phase == "rollout":
            self.back_to_step_start()  # why: a failed rollout is undone with its draw
        if not self.take_lost():
            return None
        if isinstance(err, RankFailure):
            return "every rank was restarted from the state before the step"
        stopped = (
            f"{phase} was stopped on every rank (a rank cannot be interrupted alone: the others would wait "
            "for it); the next command starts them from their state when this step began, and lab.step() "
            "runs the step again from its rollout"
        )
        if isinstance(err, BaseException):
            err.add_note(f"every rank was stopped: {stopped}")
        return stopped

    def rollback(self, state) -> None:
        if self.ranks is not None and (state.snapshot is not None or state.gradients):
            self.ranks.call("rollback", describe="rollback")

    def result(self, state, seconds: dict):
        """Rank 0's result, with the driver's phase times."""
        result = self.sync_result
        result.phase_seconds = seconds
        result.step_seconds = sum(seconds.values())
        result.sync_seconds = seconds.get("sync", 0.0)
        result.attempts = state.attempts
        return result

    # --- rank-wide operations ---
    def inspect(self) -> list[dict]:
        out = []
        for rank, (status, value) in enumerate(self.ranks.each("inspect")):
            if status != "ok":
                raise LabError(f"inspect failed on rank {rank}: {value}")
            out.append(value)
        return out

    def arm_fault(self, rank: int, phase: str, error: str) -> None:
        procs = self.config.placement.learner_procs
        if not 0 <= rank < procs:
            raise LabError(f"arm_fault: rank {rank} does not exist; ranks are 0..{procs - 1}")
        if phase == "rollout" and self.own_engine:
            raise LabError(
                f"arm_fault: a rollout fault goes into a rank's hf decoding; with generator.backend: "
                f"{self.config.generator.backend} the driver's engine samples; arm logprobs or backward"
            )
        status, value = self.ranks.one(rank, "arm_fault", phase, error)
        if status != "ok":
            raise LabError(f"arm_fault failed on rank {rank}: {value}")

    def save_adapter(self, path) -> Path:
        self.ranks.call("save_adapter", str(path), describe="save_adapter")
        return Path(path)

    def save_checkpoint(self, path) -> Path:
        """Every rank gathers; rank 0 writes, with this process's data position (the ranks hold none)."""
        self.ranks.call("save_checkpoint", str(path), self.prompts.state_dict(), describe="save_checkpoint")
        return Path(path)

    def restore_checkpoint(self, checkpoint) -> None:
        from ...recovery.checkpoint import restore_data

        self.ranks.call("restore_checkpoint", str(checkpoint.path), describe="restore_checkpoint")
        restore_data(self.prompts, self.config, checkpoint, checkpoint.load_state()["data"])
        self.step_start = None
        self.generator_behind = self.generator is not None


def prompt_tokenizer(model_path: str, config):
    """The tokenizer each rank's learner loads, with model.chat_template as each rank gives it: the driver formats
    every step's prompts with it."""
    from ...models.learner import load_tokenizer
    from ...models.source import resolve_model_path
    from ...tools.template import use_chat_template

    tokenizer = load_tokenizer(resolve_model_path(model_path))
    use_chat_template(tokenizer, config.model.chat_template)
    return tokenizer
