"""`Lab`: the notebook's handle on a GRPO run. It holds the config, learner, generator,
reference, prompts and history; each phase of a step is a method a cell can call alone,
and `step()` composes them. The headless runner, the widgets and papermill use the same calls.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from . import step as phases
from .config import LabConfig, load_config
from .errors import LabError, NonFinite
from .guard import check_learner
from .phases import Timeline
from .rewards import resolve_reward
from .types import Advantages, LogProbs, LossStats, Rewards, Rollout, StepResult


def preflight(config: LabConfig) -> None:
    """Everything that can be checked before a weight is loaded."""
    from .data import load_rows
    from .devices import check_model_path, check_placement, check_torchvision

    check_torchvision()
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


class Lab:
    def __init__(self, config: Union[LabConfig, dict, str, Path], reward_funcs: Optional[list[Callable]] = None,
                 overrides: Optional[list[str]] = None):
        self.config = load_config(config, overrides)
        self.reward_funcs = [resolve_reward(r) for r in (reward_funcs or self.config.data.rewards)]
        self.learner = self.generator = self.reference = self.prompts = self.memory = None
        self.timeline = Timeline()
        self.history: list[StepResult] = []
        self.step_index = 0   # the step the next phase belongs to
        self._saved_state = None   # host copy of LoRA + optimizer state, taken before a step's first update
        self.leaks = None
        self._plots: list = []

    # --- setup ---
    def load(self) -> "Lab":
        """Check the plan, then load the learner, reference, generator and prompts."""
        from .data import PromptSource, load_rows
        from .generation import backend_class
        from .learner import load_learner
        from .reference import build_reference

        from .memory import LeakDetector, MemorySampler

        cfg = self.config
        preflight(cfg)
        if self.memory is None:  # why first: the sampler sees the memory that loading itself takes
            self.memory = MemorySampler(self.devices(), cfg.memory.sample_hz, cfg.memory.host_threshold,
                                        describe_offload=self.describe_offload).start()
            self.timeline.listeners.append(self.memory)
            self.leaks = LeakDetector(cfg.memory.leak_window, cfg.memory.leak_min_growth_mib * 1024 ** 2)
            if cfg.memory.cuda_snapshots:
                from .memory.snapshots import AllocatorSnapshots

                where = Path(cfg.run.output_dir or ".") / "memory_snapshots"
                self.timeline.listeners.append(AllocatorSnapshots(where, self.devices()))
        self.learner = load_learner(cfg)
        check_learner(self.learner.model, [cfg.placement.learner])
        self.reference = build_reference(cfg)
        self.generator = backend_class(cfg.generator.backend)(self.learner, cfg)
        rows = load_rows(cfg.data.dataset, cfg.data.num_prompts, cfg.run.seed)
        self.prompts = PromptSource(rows, self.learner.tokenizer, cfg.data.system_prompt, cfg.run.seed)
        torch.manual_seed(cfg.run.seed)  # why here: sampling randomness starts from the seed, whatever loading consumed
        return self

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

    @contextmanager
    def _phase(self, name: str):
        """Time and mark a phase; an out-of-memory error becomes a one-line LabError naming phase and device."""
        from .memory.oom import as_lab_error, is_oom, release_memory

        try:
            with self.timeline.phase(name, self.step_index):
                yield
        except NonFinite as err:
            err.step = self.step_index
            raise
        except BaseException as err:
            if not is_oom(err):
                raise
            error = as_lab_error(err, name, self.step_index, self.config.placement.learner, self.memory)
            err.__traceback__ = None
            del err  # why: the traceback's frames hold the failed phase's tensors
            release_memory()
            raise error from None

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
        return Placement(self.config)

    def plan(self):
        """The per-device memory plan of the current config (nothing is loaded)."""
        from .planner import plan

        return plan(self.config)

    def _require_loaded(self):
        if self.learner is None:
            raise LabError("the lab is not loaded; call lab.load() first")

    # --- the phases of a step, each timed and marked ---
    def rollout(self) -> Rollout:
        self._require_loaded()
        with self._phase("rollout"):
            return phases.rollout(self.generator, self.prompts, self.config)

    def rewards(self, rollout: Rollout) -> Rewards:
        with self._phase("rewards"):
            return phases.score(rollout, self.reward_funcs, self.config.data.reward_weights)

    def advantages(self, rewards: Rewards) -> Advantages:
        with self._phase("advantages"):
            return phases.compute_advantages(rewards, self.config.grpo.scale_rewards)

    def logprobs(self, rollout: Rollout) -> LogProbs:
        self._require_loaded()
        with self._phase("logprobs"):
            return phases.compute_logprobs(self.learner, self.reference, rollout, self.config)

    def loss_and_backward(self, rollout: Rollout, advantages: Advantages, logprobs: LogProbs) -> LossStats:
        self._require_loaded()
        with self._phase("backward"):
            return phases.loss_and_backward(self.learner, rollout, advantages, logprobs, self.config)

    def optimizer_step(self) -> float:
        from .rollback import TrainState

        self._require_loaded()
        if self._saved_state is None:
            self._saved_state = TrainState(self.learner)
        try:
            with self._phase("optimizer"):
                return phases.optimizer_step(self.learner, self.config.grpo.max_grad_norm)
        except BaseException:
            self.rollback()
            raise

    def sync(self) -> None:
        self._require_loaded()
        with self._phase("sync"):
            phases.sync_generator(self.generator, self.learner)

    # --- composition ---
    def step(self) -> StepResult:
        """Run one whole GRPO step and append its result to `history`. All or nothing: if any phase
        fails (out of memory included), LoRA weights and optimizer state are left as they were."""
        from .memory.leaks import end_of_step

        self._require_loaded()
        check_learner(self.learner.model, [self.config.placement.learner])  # why every step: a wrap in a cell spills at once
        self._saved_state = None
        try:
            result = phases.step(self)
        except BaseException:
            self.rollback()
            raise
        self._saved_state = None   # why: the step succeeded; drop the host copy
        result.memory = self.memory.rows_for(self.step_index)
        result.leaks = self.leaks.observe(end_of_step(result.memory))
        self.history.append(result)
        self.step_index += 1
        return result

    def rollback(self) -> None:
        """Undo the current step's updates (if any) and drop its gradients."""
        if self._saved_state is not None:
            self._saved_state.restore(self.learner)
            self._saved_state = None
        elif self.learner is not None:
            self.learner.optimizer.zero_grad(set_to_none=True)  # why: partial gradients of a failed backward

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

        step = self.history[-1].step if step is None else step
        return format_table(self.memory.rows_for(step))

    def run(self, steps: int) -> list[StepResult]:
        return [self.step() for _ in range(steps)]

    def save_adapter(self, path: Union[str, Path]) -> Path:
        from .learner import save_adapter

        self._require_loaded()
        return save_adapter(self.learner, path)

    def close(self) -> None:
        """Stop the sampler, release the generator and models (the Python objects go with the Lab)."""
        for plot in self._plots:
            plot.stop()
        if self.memory is not None:
            self.memory.stop()
        if self.generator is not None:
            self.generator.close()
        self.learner = self.generator = self.reference = None


class Placement:
    """Who sits where; prints as the device plan."""

    def __init__(self, config: LabConfig):
        self.config = config

    def roles(self) -> dict[str, list[str]]:
        cfg, place = self.config, self.config.placement
        out: dict[str, list[str]] = {}
        learner = "learner (4-bit base + LoRA" + (", AdamW state in host RAM)" if place.optimizer_offload else " + AdamW)")
        out.setdefault(place.learner, []).append(learner)
        for device in place.generator_devices():
            shared = " colocated" if device == place.learner else ""
            out.setdefault(device, []).append(f"generator ({cfg.generator.backend}{shared})")
        if cfg.reference_strategy == "copy":
            out.setdefault(cfg.reference_device, []).append("reference (frozen copy)")
        elif cfg.reference_strategy == "adapter-disabled":
            out[place.learner].append("reference (adapter disabled, no copy)")
        return out

    @property
    def mode(self) -> str:
        place = self.config.placement
        return "colocated" if place.learner in place.generator_devices() else "split"

    def __repr__(self) -> str:
        lines = [f"placement ({self.mode}):"]
        lines += [f"  {device:<8} {', '.join(roles)}" for device, roles in self.roles().items()]
        return "\n".join(lines)
