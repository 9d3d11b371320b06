"""`LocalExecutor`: a Lab's phases on this process's learner, reference, generator and prompts (contract.py has the
contract). It also runs inside each rank of a sharded learner, whose runtime says which rank it is; a sharded
learner's driver uses `RankExecutor` (sharded/driver.py) instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from ..algo import grpo
from ..checks.guard import check_learner
from ..errors import LabError
from ..models.fsdp import FSDP
from ..models.reward_model import RewardModel, load_reward_model
from ..runtime import runtime
from ..tools import check_tools_config
from ..tools.template import prepare_for_tools, use_chat_template
from .expert_counts import backward_count, counted, rollout_count
from .reward_inputs import check_new_reward_models, reward_sources, reward_state, scorers


def _rollout(ex, state) -> object:
    if ex.generator_behind:  # never sample from weights the learner no longer has
        grpo.sync(ex.generator, ex.learner)
        ex.generator_behind = False
    from ..planner.plan import parking_reserve, rollout_copy_mode, rollout_decode

    ex.prompts.draw_for(state.index)  # why: a rollout that fails is undone with its draw (failed below)
    path = rollout_decode(ex.config), rollout_copy_mode(ex.config), parking_reserve(ex.config)
    return grpo.rollout(ex.generator, ex.prompts, ex.config, *path)


def _optimizer(ex, state) -> float:
    from ..recovery.rollback import RollbackSnapshot

    if state.snapshot is None:  # the step's first update takes the rollback snapshot first
        state.snapshot = RollbackSnapshot(ex.learner)
    return grpo.optimizer(ex.learner, ex.config)


def _sync(ex, state) -> None:
    grpo.sync(ex.generator, ex.learner)
    ex.generator_behind = False


# each phase's work in one process (phases.PHASES order), given the executor, the step's state and its inputs
LOCAL: dict[str, Callable] = {
    "rollout": counted(_rollout, rollout_count),
    "rewards": lambda ex, state, rollout: grpo.rewards(rollout, *reward_sources(ex), reward_state(ex)),
    "advantages": lambda ex, state, rewards: grpo.advantages(rewards, ex.config.grpo.scale_rewards),
    "logprobs": lambda ex, state, rollout: grpo.logprobs(ex.learner, ex.reference, rollout, ex.config),
    "backward": counted(
        lambda ex, state, rollout, advantages, logprobs: grpo.backward(
            ex.learner, rollout, advantages, logprobs, ex.config, state.old_logprobs
        ),
        backward_count,
    ),
    "optimizer": _optimizer,
    "sync": _sync,
}


def put_back(generator, device: str) -> None:
    """The learner's state a parked rollout left in host memory (the hf generator's Parking), back on `device`; an
    out-of-memory error is one line (what is still held stays held: the next command tries again)."""
    from ..memory.oom import is_oom, release_memory

    parking = getattr(generator, "parking", None)
    if parking is None or not parking.pending:
        return
    release_memory()  # why: the failed rollout's cached blocks first, so the learner has the room it had
    try:
        parking.put_back()
    except Exception as err:
        if not is_oom(err):
            raise
        held = f"{parking.pending} tensors, {parking.pending_bytes() / 2**20:.0f} MiB"
        raise LabError(
            f"the learner's state parked for the last rollout ({held}) is still in host memory: putting it back on "
            f"{device} ran out of memory; free memory there (another process, a tensor a cell keeps) and run the "
            "command again: nothing is lost"
        ) from None


def start_generator(config, learner, on_rank: bool = False):
    """The config's generator over `learner`. A backend with weights of its own starts with the GPU share the plan
    prints (the planner's `engine_share`: the number set, or auto's), handed over here because the planner stands on
    the generators; a rank's sampler asks the driver's engine and holds none."""
    from ..generation import backend_class
    from ..generation.registry import OWN_WEIGHTS
    from ..planner import engine_share

    name = config.generator.backend
    own = name in OWN_WEIGHTS and not on_rank
    return backend_class(name, on_rank=on_rank)(learner, config, **({"gpu_share": engine_share(config)} if own else {}))


def attach_engine(memory, generator) -> None:
    """An in-process engine's tensors get their own layer in its GPU's ledger (memory.readers.gpu_ledger)."""
    device = getattr(generator, "engine_device", None)
    if memory is not None and device is not None:
        memory.attach_engine(device, generator.engine_share)


class LocalExecutor:
    """The phases on this process's models."""

    name = "local"
    sharding = FSDP()  # this process's learner under FSDP2 when it is a rank's shard, else as it is

    def __init__(
        self, config, reward_funcs: Optional[list], step_index: Callable[[], int], train_dataset=None, tools=None
    ):
        from ..algo.rewards import reward_functions

        self.config = config
        self.tools = tools  # the Lab's tools and environments (tools.Tools), None without
        self.train_dataset = train_dataset  # the Lab's own dataset object (None: data.dataset names one)
        self.opened = None  # the dataset preflight opened and checked, which the next build_prompts takes
        self.rewards_given = reward_funcs is not None
        self.reward_funcs = reward_functions(scorers(reward_funcs, config), config)
        self.reward_models: list = []  # data.reward_models' scorers, after the functions (built at load)
        self.step_index = step_index
        self.learner = self.generator = self.reference = self.prompts = None
        self.reference_strategy: Optional[str] = None  # the strategy the reference was built with
        self.generator_behind = False  # a failed sync may have left the engine on weights the learner undid

    @property
    def loaded(self) -> bool:
        return self.learner is not None

    # --- memory: what this process watches ---
    def devices(self) -> list[str]:
        """The devices this process's memory sampler watches (the runtime's answer: a rank its own device), and the
        reward models' (one process)."""
        scored = self.config.data.reward_models or any(isinstance(f, RewardModel) for f in self.reward_funcs)
        rewards = [self.config.placement.reward_model_device()] if scored and not runtime().is_rank else []
        return list(dict.fromkeys([*runtime().watched_devices(self.config), *rewards]))

    def memory_sampler(self):
        from ..memory import MemorySampler
        from ..memory.readers import host_budget

        config = self.config
        if runtime().is_rank:  # its own budget (placement.rank_memory_gib), its guard's word agreed by every rank
            from .sharded.rank_guard import rank_sampler

            return rank_sampler(config, self.devices(), self.describe_offload)
        # why the driver guards the machine: one host, one guard; a rank's own budget is the rank's (above)
        kernel = None
        if config.placement.host_limit == "cgroup":  # why: the kernel kills at the budget, the guard reads its count
            from ..memory.kernel_limit import KernelLimit

            kernel = KernelLimit(host_budget(config), config.memory.host_threshold)
        return MemorySampler(
            self.devices(),
            config.memory.sample_hz,
            config.memory.host_threshold,
            describe_offload=self.describe_offload,
            host_budget=host_budget(config),
            live=True,  # why: stop a phase at the line, before the OS kills the process (a rank's: rank_guard.py)
            kernel=kernel,
        )

    def listeners(self) -> list:
        """Extra timeline listeners: allocator snapshots, one folder per rank."""
        config = self.config
        if not config.memory.cuda_snapshots:
            return []
        from ..memory.snapshots import AllocatorSnapshots

        return [AllocatorSnapshots(runtime().snapshot_dir(config.run.output_dir), self.devices())]

    def describe_offload(self) -> str:
        """What of the run lives in host RAM, for the host-RAM guard's message."""
        config, on_host = self.config, []
        if config.placement.learner == "cpu":
            on_host.append("the learner (placement.learner=cpu)")
        if config.reference_strategy == "copy" and config.reference_device == "cpu":
            on_host.append("the reference copy (reference.device=cpu)")
        if self.reward_models and config.placement.reward_model_device() == "cpu" and config.placement.learner != "cpu":
            on_host.append("the reward models (placement.reward_model=cpu)")
        return "in host RAM: " + ", ".join(on_host) if on_host else ""

    @property
    def on_cuda(self) -> bool:
        """Whether the learner computes on a GPU (phases then get NVTX ranges too)."""
        return self.learner is not None and self.learner.device.type == "cuda"

    # --- load and release ---
    def load(self, memory) -> None:
        from ..models.learner import load_learner

        config = self.config
        if config.placement.learner.startswith("cuda"):  # why before the weights: every segment from here on grows
            from ..runtime import expandable_segments

            expandable_segments(config.memory.cuda_expandable_segments)
        if self.tools is not None:  # (the backend and layout may have been edited since construction)
            check_tools_config(config)
        self.learner = load_learner(config, self.sharding)
        use_chat_template(self.learner.tokenizer, config.model.chat_template)  # why here: before prompts use it
        if self.tools is not None:
            prepare_for_tools(self.learner.tokenizer)
        self.check_learner()
        self.build_reference()
        self.generator = start_generator(config, self.learner, on_rank=runtime().is_rank)
        if self.tools is not None:  # the backend's chunks then run turn by turn through the tool loop
            self.generator.turns = self.tools.loop(self.learner.tokenizer, self.generator.eos_token_ids, config)
            self.generator.turns.marker = memory.mark  # (each turn and its tools marked inside the rollout phase)
        attach_engine(memory, self.generator)
        self.build_prompts()
        self.build_reward_models()

    def build_reference(self) -> None:
        """The reference the config asks for (at load, and when grpo.beta or reference.strategy change it)."""
        from ..models.reference import build_reference

        self.reference = build_reference(self.config)
        self.reference_strategy = self.config.reference_strategy

    def build_prompts(self) -> None:
        """The prompt source of data.* or of the Lab's train_dataset (at load, and when a data field changes); says
        in one line how many prompts generator.max_prompt_length cuts. A rank's: the rows its driver hands it."""
        from ..data.prompts import HandedPrompts, prompt_source

        if runtime().is_rank:  # why: the driver opens the data once and draws every step's rows (sharded/driver.py)
            self.prompts = HandedPrompts()
            return
        opened, self.opened = self.opened, None
        tools = self.tools.schemas if self.tools is not None else None  # why: they lengthen every prompt the plan holds
        self.prompts = prompt_source(self.config, self.learner.tokenizer, self.train_dataset, opened, tools=tools)

    def build_reward_models(self) -> None:
        """data.reward_models loaded on placement.reward_model, and the sequence classifiers passed in reward_funcs
        moved there (at load, and when data.reward_models changes)."""
        device = self.config.placement.reward_model_device()
        for model in self.reward_models:
            model.release()  # why first: the old models go before the new ones load
        self.reward_models = []
        if runtime().is_rank:
            return  # a sharded learner's driver scores; it hands each rank the scores (take_scores)
        self.reward_models = [load_reward_model(name, self.config, device) for name in self.config.data.reward_models]
        for fn in self.reward_funcs:
            if isinstance(fn, RewardModel):
                fn.to(device)

    def take_scores(self, scores: list[tuple[str, list[float]]]) -> None:
        """A rank: the reward models' scores of this step's rollout, as the driver computed them, (name, scores) each;
        its rewards phase reads them after the reward functions, as one process reads its reward models."""
        from ..models.reward_model import GivenScores

        self.reward_models = [GivenScores(name, values) for name, values in scores]

    def release(self) -> None:
        if self.generator is not None:
            self.generator.close()
        for model in self.reward_models:
            model.release()  # why: a caller may still hold the scorer; the model's memory must not stay with it
        self.learner = self.generator = self.reference = self.prompts = None
        self.reward_models = []

    # --- edits (config/edits.py) ---
    def check_live(self, config) -> None:
        self.generator.check_live(config)
        check_new_reward_models(self.config, config)

    def memory_watch(self) -> list[str]:
        """The devices an edit may put a model on without a new Lab (knobs: a reference copy after load)."""
        return self.devices()

    # --- the step ---
    def check_learner(self) -> None:
        # why every step: a wrap in a cell spills at once; the runtime's device, so a rank checks its own GPU
        check_learner(self.learner.model, [runtime().device(self.config)])

    def compute(self, name: str, state, *inputs):
        return LOCAL[name](self, state, *inputs)

    def before_command(self) -> bool:
        """Whether the step's progress was lost since the last command (never, in one process). First, what a
        parked rollout could not put back (out of memory) goes back, before anything reads the learner."""
        put_back(self.generator, runtime().device(self.config))
        return False

    def failed(self, phase: str, err: Optional[BaseException]) -> Optional[str]:
        """After a failed phase: FSDP's iteration state reset on every model this process passes through (a failure
        mid-forward leaves it half-way); None = the Lab's default undo applies."""
        from ..models.failed_pass import reset_after_failure

        for model in (getattr(self.learner, "model", None), getattr(self.reference, "model", None)):
            if model is not None:
                reset_after_failure(model)
        try:  # a parked rollout that failed putting the learner back: once more now
            put_back(self.generator, runtime().device(self.config))
        except LabError:
            pass  # still held; the next command tries again, and says so if it cannot
        self.generator_behind |= phase == "sync"  # why: the engine may hold the adapter the rollback undoes
        if phase == "rollout" and self.prompts is not None:
            self.prompts.undraw(self.step_index())  # the retry samples the step's own prompts
        return None

    def rollback(self, state) -> None:
        if state.snapshot is not None:
            state.snapshot.restore(self.learner)
        elif self.learner is not None:
            self.learner.optimizer.zero_grad(set_to_none=True)  # why: partial gradients of a failed backward

    def result(self, state, seconds: dict):
        return grpo.summarize(
            state.index,
            state.rollout,
            state.rewards,
            state.advantages,
            state.stats,
            state.grad_norm,
            seconds,
            state.updates,
            state.attempts,
            self.learner.optimizer.param_groups[0]["lr"],
        )

    # --- state in and out ---
    def inspect(self) -> list[dict]:
        """This process's LoRA and AdamW state and step (one entry: rank 0 of a world of one)."""
        from ..generation.hf import GENERATED_ROWS
        from ..models.fsdp import WHOLE_GATHERS, base_placements, layout, local, local_state

        learner, copy = self.learner, getattr(self.reference, "model", None)
        return [
            {
                "rank": runtime().rank,
                "step": self.step_index(),
                "layout": layout(learner.model),
                "whole_gathers": WHOLE_GATHERS[0],
                "generated_rows": GENERATED_ROWS[0],
                "placements": base_placements(learner.model),
                "reference_placements": None if copy is None else base_placements(copy),
                "lora": {n: local(p).detach().clone() for n, p in learner.trainable_parameters().items()},
                "optimizer": local_state(learner.optimizer.state_dict()),
            }
        ]

    def arm_fault(self, rank: int, phase: str, error: str) -> None:
        from ..recovery import faults

        if rank != runtime().rank:
            raise LabError(f"arm_fault: rank {rank} does not exist; this Lab is one process (rank 0)")
        if error == "kill" and not runtime().is_rank:
            raise LabError(
                "arm_fault: error 'kill' kills a sharded learner's rank process; this Lab is one process, "
                "which it would kill with your kernel; use oom or runtime"
            )
        if error == "diverge" and not runtime().sharded:
            raise LabError(
                "arm_fault: 'diverge' alters the rollout checksum a sharded learner's ranks agree on; this "
                "Lab is one process (set placement.learner_procs: 2)"
            )
        if phase == "rollout" and self.config.generator.own_weights:
            raise LabError(
                f"arm_fault: a rollout fault goes into hf decoding; generator.backend: "
                f"{self.config.generator.backend} samples in its engine; arm logprobs or backward"
            )
        faults.arm(phase, error)
        for model in (self.learner.model, getattr(self.reference, "model", None)):
            if model is not None:
                faults.watch_forward(model)

    def save_adapter(self, path) -> Path:
        if runtime().is_rank:  # every rank gathers its LoRA shards; rank 0 writes the one-process format
            from .sharded.gathered import save_full_adapter

            save_full_adapter(self.learner, path)
            return Path(path)
        from ..models.learner import save_adapter

        return save_adapter(self.learner, path)

    def save_checkpoint(self, path) -> Path:
        if runtime().is_rank:  # every rank gathers its shards and RNG states; rank 0 writes
            from .sharded.gathered import save_full_checkpoint

            save_full_checkpoint(self.learner, self.prompts, self.config, self.step_index(), path)
            return Path(path)
        from ..recovery.checkpoint import save_checkpoint

        return save_checkpoint(self.learner, self.prompts, self.config, self.step_index(), path)

    def restore_checkpoint(self, checkpoint) -> None:
        if runtime().is_rank:  # this rank's shard of every tensor, its own RNG states
            from .sharded.gathered import restore_full_checkpoint

            restore_full_checkpoint(self.learner, self.prompts, checkpoint.path)
        else:
            from ..recovery.checkpoint import restore_checkpoint

            restore_checkpoint(self.learner, self.prompts, self.config, checkpoint)
        grpo.sync(self.generator, self.learner)  # why: the engine must sample from the restored weights
        self.generator_behind = False
