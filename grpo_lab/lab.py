"""`Lab`: the notebook's handle on a GRPO run. It holds the config, learner, generator,
reference, prompts and history; each phase of a step is a method a cell can call alone (named
as in phases.PHASES), and `step()` runs the rest of the current step. The headless runner, the
widgets and papermill use the same calls. Config edits after load go through knobs.py.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from . import step as phases
from .config import LabConfig, load_config
from .errors import ConfigError, LabError, NonFinite
from .guard import check_learner
from .lifecycle import StepState, check_order
from .phases import BY_NAME, PHASE_NAMES, UPDATE_PHASES
from .timeline import Timeline
from .rewards import resolve_reward
from .types import Advantages, LogProbs, LossStats, Rewards, Rollout, StepResult


def preflight(config: LabConfig) -> None:
    """Everything that can be checked before a weight is loaded."""
    from .data import load_rows
    from .devices import check_model_path, check_placement, check_torchvision

    from .sharded.world import check_ranks

    check_torchvision()
    check_ranks(config)   # more ranks than devices, no FSDP2 in this torch: before any process starts
    check_model_path(config.model.name_or_path)
    if config.generator.backend == "vllm":
        from .generation.vllm import check_tensor_parallel, max_lora_rank

        max_lora_rank(config.lora.r)
        check_tensor_parallel(config)
    check_placement(config)
    if config.generator.backend == "hf":
        from .generation.hf import check_hf_placement

        check_hf_placement(config)
    for name in config.data.rewards:
        resolve_reward(name)
    if config.data.dataset != "arithmetic":
        rows = load_rows(config.data.dataset, config.data.num_prompts, config.run.seed)
        if config.grpo.prompts_per_step > len(rows):
            raise LabError(f"grpo.prompts_per_step: {config.grpo.prompts_per_step} distinct prompts per step, but "
                           f"data.dataset has {len(rows)} rows; lower it or use a bigger dataset")


def _local_rollout(lab) -> Rollout:
    if lab._generator_behind:   # never sample from weights the learner no longer has
        phases.sync(lab.generator, lab.learner)
        lab._generator_behind = False
    return phases.rollout(lab.generator, lab.prompts, lab.config)


def _local_optimizer(lab) -> float:
    from .rollback import TrainState

    if lab._step.snapshot is None:   # the step's first update takes the rollback snapshot first
        lab._step.snapshot = TrainState(lab.learner)
    return phases.optimizer(lab.learner, lab.config)


def _local_sync(lab) -> None:
    phases.sync(lab.generator, lab.learner)
    lab._generator_behind = False


# each phase's work in one process (phases.PHASES order), given the Lab and the phase's inputs
LOCAL: dict[str, Callable] = {
    "rollout": _local_rollout,
    "rewards": lambda lab, rollout: phases.rewards(rollout, lab.reward_funcs, lab.config.data.reward_weights),
    "advantages": lambda lab, rewards: phases.advantages(rewards, lab.config.grpo.scale_rewards),
    "logprobs": lambda lab, rollout: phases.logprobs(lab.learner, lab.reference, rollout, lab.config),
    "backward": lambda lab, rollout, advantages, logprobs: phases.backward(lab.learner, rollout, advantages, logprobs,
                                                                           lab.config),
    "optimizer": _local_optimizer,
    "sync": _local_sync,
}


class Lab:
    def __new__(cls, config=None, *args, **kwargs):
        """`Lab(config)` with placement.learner_procs > 1 is a ShardedLab: the same API, over worker processes."""
        from .sharded.world import world

        if cls is Lab and config is not None and not world().sharded:   # (a rank's own Lab is a plain one)
            procs = load_config(config, kwargs.get("overrides") or (args[1] if len(args) > 1 else None)).placement.learner_procs
            if procs > 1:
                from .sharded.driver import ShardedLab

                cls = ShardedLab
        return super().__new__(cls)

    def __init__(self, config: Union[LabConfig, dict, str, Path], reward_funcs: Optional[list[Callable]] = None,
                 overrides: Optional[list[str]] = None):
        self._config = load_config(config, overrides)
        self.reward_funcs_given = reward_funcs is not None
        self.reward_funcs = [resolve_reward(r) for r in (reward_funcs or self._config.data.rewards)]
        self.learner = self.generator = self.reference = self.prompts = self.memory = None
        self.reference_strategy: Optional[str] = None   # the strategy the reference was built with
        self.memory_devices: list[str] = []              # the devices the sampler watches
        self.timeline = Timeline()
        self.history: list[StepResult] = []
        self._step = StepState(index=0)
        self._generator_behind = False   # a failed sync may have left the engine on weights the learner undid
        self._busy = threading.Lock()    # one phase at a time: a panel run and a cell must not interleave
        self.leaks = None
        self.trackers = None             # run.report_to, opened at load
        self._plots: list = []

    # --- the config: one edit path (see knobs.py) ---
    @property
    def config(self) -> LabConfig:
        return self._config

    @config.setter
    def config(self, new: Union[LabConfig, dict]) -> None:
        """Assigning a whole config applies the fields that differ, as `configure` does (a loaded Lab refuses
        load-time ones)."""
        self._config.assign(new if isinstance(new, LabConfig) else load_config(new))

    def configure(self, changes: Optional[dict] = None, **sections) -> dict:
        """Change several fields at once, checked together: `lab.configure({"grpo.beta": 0.04})` or
        `lab.configure(grpo={"beta": 0.04}, generator={"temperature": 0.7})`. Live fields apply at the next
        phase that reads them, rebuild fields rebuild their part now, load-time fields are refused after
        load. Returns {field: (old, new)} of what changed."""
        flat = dict(changes or {})
        for section, values in sections.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{section}: got {values!r}; pass a mapping of its fields, e.g. grpo={{'beta': 0.04}}")
            flat.update({f"{section}.{name}": value for name, value in values.items()})
        return self._config.update(flat)

    # --- setup ---
    def load(self) -> "Lab":
        """Check the plan, then load the learner, reference, generator and prompts. A failure part-way
        releases what was loaded (the sampler thread included), so the Lab can load again."""
        if self.learner is not None:
            raise LabError("lab.load(): this Lab is loaded already; lab.close() it first, or make a new Lab")
        try:
            return self._load()
        except BaseException:
            self._release()
            self.memory = self.leaks = None   # why: a failed load leaves no sampler behind; the next load starts its own
            self.timeline.listeners.clear()
            raise

    def _load(self) -> "Lab":
        from .generation import backend_class
        from .knobs import LoadedLabGuard
        from .learner import load_learner

        from .memory import LeakDetector, MemorySampler

        cfg = self.config
        preflight(cfg)
        if self.memory is None:  # why first: the sampler sees the memory that loading itself takes
            self.memory_devices = self.devices()
            self.memory = MemorySampler(self.memory_devices, cfg.memory.sample_hz, cfg.memory.host_threshold,
                                        describe_offload=self.describe_offload).start()
            self.timeline.listeners.append(self.memory)
            self.leaks = LeakDetector(cfg.memory.leak_window, cfg.memory.leak_min_growth_mib * 1024 ** 2)
            if cfg.memory.cuda_snapshots:
                from .memory.snapshots import AllocatorSnapshots

                where = Path(cfg.run.output_dir or ".") / "memory_snapshots"
                self.timeline.listeners.append(AllocatorSnapshots(where, self.devices()))
        self.learner = load_learner(cfg)
        check_learner(self.learner.model, [cfg.placement.learner])
        self._build_reference()
        self.generator = backend_class(cfg.generator.backend)(self.learner, cfg)
        self._build_prompts()
        from .trackers import Trackers

        self.trackers = Trackers(cfg)    # last: a load that fails earlier opens no tracker run
        torch.manual_seed(cfg.run.seed)  # why here: sampling randomness starts from the seed, whatever loading consumed
        cfg._guard = LoadedLabGuard(self)   # why: from now on every edit is checked against what was built
        return self

    def _build_reference(self) -> None:
        """The reference the config asks for (at load, and when grpo.beta or reference.strategy change it)."""
        from .reference import build_reference

        self.reference = build_reference(self.config)
        self.reference_strategy = self.config.reference_strategy

    def _build_prompts(self) -> None:
        """The prompt source of data.* (at load, and when one of them changes)."""
        from .data import PromptSource, load_rows

        cfg = self.config
        rows = load_rows(cfg.data.dataset, cfg.data.num_prompts, cfg.run.seed)
        self.prompts = PromptSource(rows, self.learner.tokenizer, cfg.data.system_prompt, cfg.run.seed)

    def _release(self) -> None:
        """Stop the sampler and plots, close the generator, drop the models (close() and a failed load).
        The stopped sampler's records stay readable (reports, tables)."""
        for plot in self._plots:
            plot.stop()
        if self.memory is not None:
            self.memory.stop()
        if self.generator is not None:
            self.generator.close()
        if self.trackers is not None:
            self.trackers.close()
        self.learner = self.generator = self.reference = self.prompts = self.trackers = None
        self._config._guard = None   # why: nothing loaded is left to protect; the config is a plain config again

    def devices(self) -> list[str]:
        """Every device the placement uses: learner, generator(s), reference copy."""
        cfg, p = self.config, self.config.placement
        ref = [cfg.reference_device] if cfg.reference_strategy == "copy" else []
        return list(dict.fromkeys([p.learner, *p.generator_devices(), *ref]))

    def describe_offload(self) -> str:
        """What of the run lives in host RAM, for the host-RAM guard's message."""
        cfg, on_host = self.config, []
        if cfg.placement.learner == "cpu":
            on_host.append("the learner (placement.learner=cpu)")
        if cfg.reference_strategy == "copy" and cfg.reference_device == "cpu":
            on_host.append("the reference copy (reference.device=cpu)")
        return "in host RAM: " + ", ".join(on_host) if on_host else ""

    # --- placement and plan ---
    def place(self, learner=None, generator=None, reference=None, optimizer_offload=None) -> "Placement":
        """Choose devices before `load()`: validated at once (devices exist; a colocated generator with its
        own weights needs generator.gpu_memory_utilization); `lab.placement` shows the result."""
        from .devices import check_placement

        if self.learner is not None:
            raise LabError("lab.place(): the models are loaded already; call it before lab.load() (or in a new Lab)")
        data = self.config.to_dict()
        if learner is not None:
            data["placement"]["learner"] = learner
        if generator is not None:
            data["placement"]["generator"] = generator if isinstance(generator, (list, tuple)) else [generator]
        if reference is not None:
            data["reference"].update({"strategy": "copy", "device": reference})
        if optimizer_offload is not None:
            data["placement"]["optimizer_offload"] = optimizer_offload
        config = load_config(data)
        check_placement(config)
        self.config = config
        return self.placement

    @property
    def placement(self) -> "Placement":
        from .placement import Placement

        return Placement(self.config)

    def plan(self):
        """The per-device memory plan of the current config (nothing is loaded)."""
        from .planner import plan

        return plan(self.config)

    def _require_loaded(self):
        if self.learner is None:
            raise LabError("the lab is not loaded; call lab.load() first")

    @property
    def _on_cuda(self) -> bool:
        """Whether the learner computes on a GPU (phases then get NVTX ranges too)."""
        return self.learner is not None and self.learner.device.type == "cuda"

    # --- the step lifecycle ---
    @property
    def step_index(self) -> int:
        """The step the next phase belongs to; it advances by itself when a step's sync ends."""
        return self._step.index

    @property
    def current(self) -> StepState:
        """What the current step's phases produced so far (read-only view for cells and widgets)."""
        return self._step

    def next_phase(self) -> str:
        """The phase the current step runs next, by the lifecycle's rules."""
        s, iterations = self._step, self.config.grpo.num_iterations
        for name, done in (("rollout", s.rollout), ("rewards", s.rewards), ("advantages", s.advantages),
                           ("logprobs", s.logprobs)):
            if done is None:
                return name
        if s.gradients:
            return "optimizer"
        return "backward" if s.updates < iterations else "sync"

    @contextmanager
    def _phase(self, name: str, **inputs):
        """Check order, time and mark a phase; on any failure put the step back (see `_failed`); an
        out-of-memory error becomes a one-line LabError naming phase and device."""
        from .memory.heap import trim_host_heap
        from .memory.oom import as_lab_error, is_oom, release_memory
        from .profiling import phase_range
        from .memory.sampler import HostMemoryExceeded

        self._require_loaded()
        if not self._busy.acquire(blocking=False):
            raise LabError(f"{name}: another phase of this Lab is running (a panel run or another thread); "
                           "wait for it to finish, or press stop")
        try:
            check_order(self._step, name, self.config.grpo.num_iterations, **inputs)   # a refusal changes nothing
            trim_host_heap()   # why: a phase starts from live host memory, not the heap holes earlier phases left
            try:
                with self.timeline.phase(name, self.step_index), phase_range(name, self._on_cuda):
                    yield
            except BaseException as err:
                undone = self._failed(name)
                if isinstance(err, NonFinite):
                    err.step = self.step_index
                    raise
                if isinstance(err, HostMemoryExceeded):
                    err.undone = undone
                    raise
                if not is_oom(err):
                    raise
                error = as_lab_error(err, name, self.step_index, self.config.placement.learner, self.memory, undone)
                err.__traceback__ = None
                del err  # why: the traceback's frames hold the failed phase's tensors
                release_memory()
                raise error from None
        finally:
            self._busy.release()

    def _failed(self, phase: str) -> str:
        """A phase failed: undo the step's updates, and file the failed work as an attempt of its own.
        Returns what was put back, for the error message."""
        undone = "the step's updates were rolled back" if self._step.snapshot is not None else "no update had been applied"
        # (check_order lets no other phase run while updates or gradients are pending, so only these redo the updates)
        self._retire({phase, *UPDATE_PHASES} if phase in UPDATE_PHASES else {phase})
        self._generator_behind |= phase == "sync"   # why: the engine may hold the adapter the rollback undoes
        self.rollback()
        return undone

    def _retire(self, phases_) -> None:
        """File the current step's timings and memory rows of `phases_` as a failed attempt; the next is a new one."""
        s = self._step
        self.timeline.retire(s.index, phases_, s.attempts)
        if self.memory is not None:
            self.memory.retire(s.index, phases_, s.attempts)
        s.attempts += 1

    # --- the phases of a step (phases.PHASES), each checked, timed and marked ---
    def rollout(self) -> Rollout:
        """Start the step (or restart it, when no update was applied yet) with a fresh rollout."""
        with self._phase("rollout"):
            if self._step.started:   # a restart: the earlier rollout's phases become a failed attempt
                self._retire(PHASE_NAMES)
                self._step = StepState(index=self.step_index, attempts=self._step.attempts)
            out = self._compute("rollout")
            out.step = self.step_index
            self._step.rollout = out
        return out

    def rewards(self, rollout: Rollout) -> Rewards:
        with self._phase("rewards", rollout=rollout):
            out = self._compute("rewards", rollout)
        self._step.rewards = out
        return out

    def advantages(self, rewards: Rewards) -> Advantages:
        with self._phase("advantages", rewards=rewards):
            out = self._compute("advantages", rewards)
        self._step.advantages = out
        return out

    def logprobs(self, rollout: Rollout) -> LogProbs:
        with self._phase("logprobs", rollout=rollout):
            out = self._compute("logprobs", rollout)
        self._step.logprobs = out
        return out

    def backward(self, rollout: Rollout, advantages: Advantages, logprobs: LogProbs) -> LossStats:
        with self._phase("backward", rollout=rollout, advantages=advantages, logprobs=logprobs):
            out = self._compute("backward", rollout, advantages, logprobs)
        self._step.stats, self._step.gradients = out, True
        return out

    def optimizer(self) -> float:
        """Clip and apply the gradients. The step's first update takes the rollback snapshot first (inside
        the phase: a host out-of-memory while copying is this phase's one-line error)."""
        with self._phase("optimizer"):
            out = self._compute("optimizer")
            self._step.updates += 1
            self._step.gradients = False
        self._step.grad_norm = out
        return out

    def sync(self) -> StepResult:
        """Push the weights to the generator; this ends the step: its result joins `history`, the
        rollback snapshot is dropped and the step index advances."""
        with self._phase("sync"):
            self._compute("sync")
        return self._finish_step()

    def _compute(self, name: str, *inputs):
        """A phase's work on this process's models (a ShardedLab sends it to its ranks instead)."""
        return LOCAL[name](self, *inputs)

    def _finish_step(self) -> StepResult:
        from .memory.leaks import end_of_step

        s = self._step
        result = phases.summarize(s.index, s.rollout, s.rewards, s.advantages, s.stats, s.grad_norm,
                                  self.timeline.seconds(s.index), s.updates, s.attempts,
                                  self.learner.optimizer.param_groups[0]["lr"])
        result.memory = self.memory.rows_for(s.index)
        result.leaks = self.leaks.observe(end_of_step(result.memory))
        self.history.append(result)
        self._step = StepState(index=s.index + 1)   # why: the snapshot goes with the finished step
        self.trackers.log(result)      # after the step is recorded: a tracker's failure is only a warning
        return result

    # --- composition ---
    def run_next_phase(self) -> tuple[str, object]:
        """Run the current step's next phase with the outputs of the phases before it; returns
        (phase name, its output). The panel's phase button and `step()` both walk with it."""
        name = self.next_phase()
        args = [getattr(self._step, field) for field in BY_NAME[name].inputs]
        return name, getattr(self, name)(*args)

    def step(self) -> StepResult:
        """Run the rest of the current step (all of it, when none is under way) and return its result.
        All or nothing: if a phase fails (out of memory included), LoRA weights and optimizer state are
        as they were before the step, and calling it again retries from the failed phase."""
        self._require_loaded()
        self._check_learner()
        while True:
            name, out = self.run_next_phase()
            if name == "sync":
                return out

    def _check_learner(self) -> None:
        check_learner(self.learner.model, [self.config.placement.learner])  # why every step: a wrap in a cell spills at once

    def rollback(self) -> None:
        """Undo the current step's updates (if any) and drop its gradients; its rollout, rewards,
        advantages and log-probs are kept, so the step goes on from backward."""
        s = self._step
        if s.snapshot is not None:
            s.snapshot.restore(self.learner)
        elif self.learner is not None:
            self.learner.optimizer.zero_grad(set_to_none=True)  # why: partial gradients of a failed backward
        s.snapshot, s.updates, s.gradients, s.stats, s.grad_norm = None, 0, False, None, None

    def memory_plot(self, refresh_s: float = 0.5):
        """The live memory plot (a plotly FigureWidget redrawn every `refresh_s` seconds); display it in a cell."""
        from .memory.live import LivePlot

        self._require_loaded()
        plot = LivePlot(self.memory, refresh_s=refresh_s).start()
        self._plots.append(plot)
        return plot

    def ui(self):
        """The notebook panel: config editor, step controls and the live memory plot."""
        from .ui import Panel

        return Panel(self)

    def save_results(self, path: Union[str, Path]) -> Path:
        """Every step's metrics (with its memory table) as JSON lines: what `grpo-lab sweep` collects."""
        import json

        from .io import atomic_write_text

        return atomic_write_text(path, "".join(json.dumps(r.metrics()) + "\n" for r in self.history))

    def memory_table(self, step: Optional[int] = None) -> str:
        """The per-phase memory table (MiB) of `step` (default: the last one)."""
        from .memory import format_table

        if step is None and not self.history:
            raise LabError("lab.memory_table(): no step has finished yet; run lab.step() (or a phase walk up to its "
                           "sync) first")
        step = self.history[-1].step if step is None else step
        return format_table(self.memory.rows_for(step))

    def run(self, steps: Optional[int] = None) -> list[StepResult]:
        """`steps` steps (default: run.steps, read now)."""
        return [self.step() for _ in range(self.config.run.steps if steps is None else steps)]

    def save_adapter(self, path: Union[str, Path]) -> Path:
        from .learner import save_adapter

        self._require_loaded()
        return save_adapter(self.learner, path)

    def save_checkpoint(self, path: Union[str, Path]) -> Path:
        """Between steps, write what the next step depends on (LoRA adapter, optimizer state, RNG states,
        data position, step index) to `path`, atomically; `restore_checkpoint` (in this Lab or a new one
        with the same config) continues from there, with the same results as going on without a break."""
        from .checkpoint import save_checkpoint

        self._between_steps("lab.save_checkpoint()")
        return save_checkpoint(self, path)

    def restore_checkpoint(self, path: Union[str, Path]) -> "Lab":
        """Continue from a checkpoint: its weights, optimizer state, RNG states, data position and step
        index replace this Lab's; the generator is synced to the restored weights."""
        from .checkpoint import read_checkpoint, restore_checkpoint

        self._between_steps("lab.restore_checkpoint()")
        checkpoint = read_checkpoint(path)
        restore_checkpoint(self, checkpoint)
        self._step = StepState(index=checkpoint.step)
        phases.sync(self.generator, self.learner)   # why: the engine must sample from the restored weights
        self._generator_behind = False
        return self

    def _between_steps(self, what: str) -> None:
        self._require_loaded()
        if self._step.started:
            raise LabError(f"{what}: step {self.step_index} is under way (next phase: {self.next_phase()}); finish it "
                           "with lab.step() first")

    def close(self) -> None:
        """Stop the sampler, release the generator and models (the Python objects go with the Lab)."""
        self._release()
