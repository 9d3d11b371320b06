"""`Lab(config, reward_funcs, overrides, train_dataset, tools, environment_factory)`: the notebook's handle on a GRPO
run (the last four as TRL's GRPOTrainer takes them; None: data.rewards, data.dataset). It holds the config, the step
lifecycle, history, the timeline and the memory views; each phase of a step is a method a cell can call alone (named
as in algo/phases.PHASES), and `step()` runs the rest of the current step through `algo.grpo.step`. The phases' work
is its executor's (execution/: this process's models, or a sharded learner's ranks); config edits: config/edits.py."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from .algo import grpo
from .algo.containers import Advantages, LogProbs, LossStats, Rewards, Rollout, StepResult
from .algo.lifecycle import RestOfStep, StepState, check_between_steps, check_order, next_phase
from .algo.phases import BY_NAME, PHASE_NAMES, UPDATE_PHASES
from .config.edits import LoadedLabGuard
from .config.loading import load_config
from .config.schema import LabConfig
from .errors import ConfigError, LabError, one_line_in_cells
from .execution.contract import executor_for
from .memory.timeline import Timeline
from .preflight import preflight
from .recovery.streams import rewind_streams
from .runtime import own_streams
from .turns_api import drop_turns, rollout_phase
from .ui.quiet import no_frozen_bars
from .ui.reprs import step_results_as_tables
from .ui.views import LabViews


class Lab(LabViews):
    def __init__(
        self,
        config: Union[LabConfig, dict, str, Path],
        reward_funcs: Optional[list[Callable]] = None,
        overrides: Optional[list[str]] = None,
        train_dataset=None,
        tools: Optional[list[Callable]] = None,
        environment_factory=None,
    ):
        one_line_in_cells()  # why first: in a kernel, even this Lab's own config refusal is its one line
        step_results_as_tables()  # in a kernel, a step ending a cell shows as a table (ui/reprs.py)
        self._config = config = load_config(config, overrides)
        self.memory = self.leaks = self.trackers = None  # (trackers: run.report_to, opened at load)
        self.memory_devices: list[str] = []  # the devices the sampler watches
        self.timeline, self.history = Timeline(), []  # (history: each finished step's StepResult)
        self._step = StepState(index=0)
        self._busy = threading.Lock()  # one phase at a time: a panel run and a cell must not interleave
        self._plots: list = []
        self._rng: Optional[dict] = None  # this Lab's random streams while another Lab's are the process's
        # where the phases run: this process's models, or a sharded learner's ranks (placement.learner_procs > 1)
        self.executor = executor_for(
            config, reward_funcs, lambda: self.step_index, train_dataset, tools, environment_factory
        )

    # --- what the executor holds (this process's models; on a sharded driver, its engine) ---
    learner = property(lambda self: self.executor.learner)
    generator = property(lambda self: self.executor.generator)
    reference = property(lambda self: self.executor.reference)
    prompts = property(lambda self: self.executor.prompts)
    reference_strategy = property(lambda self: self.executor.reference_strategy)
    reward_funcs = property(
        lambda self: self.executor.reward_funcs, lambda self, f: setattr(self.executor, "reward_funcs", f)
    )

    # --- the config: one edit path (see config/edits.py) ---
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
                raise ConfigError(
                    f"{section}: got {values!r}; pass a mapping of its fields, e.g. grpo={{'beta': 0.04}}"
                )
            flat.update({f"{section}.{name}": value for name, value in values.items()})
        return self._config.update(flat)

    # --- setup ---
    def load(self) -> "Lab":
        """Check the plan, load the models, generator and prompts; a failure part-way releases all: load again."""
        if self.learner is not None:
            raise LabError("lab.load(): this Lab is loaded already; lab.close() it first, or make a new Lab")
        try:
            with no_frozen_bars():
                return self._load()
        except BaseException:
            self._release()
            self.memory = self.leaks = None  # why: a failed load leaves no sampler behind; the next load starts its own
            self.timeline.listeners.clear()
            raise

    def _load(self) -> "Lab":
        from .memory import LeakDetector
        from .memory.heap import pin_mmap_threshold
        from .trackers import Trackers

        config, executor = self.config, self.executor
        own_streams(self)  # why first: loading seeds the process's generators; another Lab's are kept, not reseeded
        executor.opened = preflight(config, executor.train_dataset)  # the data it opened: its prompt source reads it
        pin_mmap_threshold(config.memory.host_mmap_threshold_mib)  # why first: RSS holds live tensors (memory/heap.py)
        if self.memory is None:  # why first: the sampler sees the memory that loading itself takes
            self.memory_devices = executor.memory_watch()
            self.memory = executor.memory_sampler().start()
            self.timeline.listeners.append(self.memory)
            self.leaks = LeakDetector(config.memory.leak_window, config.memory.leak_min_growth_mib * 1024**2)
            self.timeline.listeners.extend(executor.listeners())
        executor.load(self.memory)
        self.trackers = Trackers(config)  # last: a load that fails earlier opens no tracker run
        torch.manual_seed(config.run.seed)  # why here: sampling starts from the seed, whatever loading consumed
        config.attach_guard(LoadedLabGuard(executor, self.memory, self.leaks, self.memory_devices))
        if config.run.probe_first:
            from .planner.worst_case import probe_at_load

            probe_at_load(self)  # a worst case that does not fit is refused here, and the load undone
        return self

    def _release(self) -> None:
        """Stop the sampler and plots, release the executor's models or ranks (close() and a failed load).
        The stopped sampler's records stay readable (reports, tables)."""
        for plot in self._plots:
            plot.stop()
        if self.memory is not None:
            self.memory.close()
        self.executor.release()
        if self.trackers is not None:
            self.trackers.close()
        self.trackers = None
        self._config.detach_guard()  # why: nothing loaded is left to protect

    # --- placement and plan ---
    def place(self, learner=None, generator=None, reference=None, optimizer_offload=None):
        """Choose devices before `load()`: validated at once (devices exist; a colocated generator with its
        own weights needs generator.gpu_memory_utilization); `lab.placement` shows the result."""
        from .planner.placement import place

        return place(self, learner, generator, reference, optimizer_offload)

    def _require_loaded(self):
        if not self.executor.loaded:
            raise LabError("the lab is not loaded; call lab.load() first")
        # e.g. a sharded learner's ranks were stopped: they start at the step's start
        if self.executor.before_command():
            self._restart_step()

    def _restart_step(self) -> None:
        """The step goes back to its start: its phases so far become a failed attempt."""
        self._retire(PHASE_NAMES)
        self._step = StepState(index=self.step_index, attempts=self._step.attempts)

    # --- the step lifecycle ---
    @property
    def step_index(self) -> int:
        """The step the next phase belongs to; it advances by itself when a step's sync ends."""
        return self._step.index

    @property
    def current(self) -> StepState:
        """What the current step's phases produced so far (a view for cells and widgets)."""
        return self._step

    @current.setter
    def current(self, state: StepState) -> None:
        """Put back a step state set aside (the worst-case probe runs a step of its own in between)."""
        self._step = state

    def next_phase(self) -> str:
        """The phase the current step runs next, by the lifecycle's rules."""
        return next_phase(self._step, self.config.grpo.num_iterations)

    @contextmanager
    def _phase(self, name: str, **inputs):
        """Check order, time and mark a phase; on any failure put the step back (see `_failed`); an
        out-of-memory error becomes a one-line LabError naming phase and device."""
        from .memory.heap import trim_host_heap
        from .memory.oom import cuda_oom_count, phase_error, release_memory
        from .memory.profiling import phase_range
        from .recovery.faults import set_phase
        from .recovery.streams import phase_streams, put_streams_back
        from .runtime import RanksBlocked, runtime, settle

        self._require_loaded()
        if not self._busy.acquire(blocking=False):
            raise LabError(
                f"{name}: another phase of this Lab is running (a panel run or another thread); "
                "wait for it to finish, or press stop"
            )
        try:
            check_order(self._step, name, self.config.grpo.num_iterations, **inputs)  # a refusal changes nothing
            streams = phase_streams(self, name)  # why a copy (a few KiB): a retry draws what the failed phase drew
            trim_host_heap()  # why: a phase starts from live host memory, not the heap holes earlier phases left
            device = runtime().device(self.config)  # this process's (a rank's own): an OOM line names it
            ooms = cuda_oom_count(device)  # why: a CUDA OOM can reach Python as another error; the allocator counts it
            try:
                set_phase(name)  # an armed fault (lab.arm_fault) fires only inside its phase
                with self.timeline.phase(name, self.step_index), phase_range(name, self.executor.on_cuda):
                    yield
                    settle(name, failed=False)  # on a rank: another rank's failure fails this phase here too
            except BaseException as err:
                if not getattr(err, "agreed", False):  # (a failure already agreed mid-phase is not asked twice)
                    try:
                        settle(name, failed=True)  # on a rank: the others learn it and take the same branch
                    except RanksBlocked as blocked:  # they are stuck in a collective: the driver restarts every rank
                        err.add_note(str(blocked))
                undone = self._failed(name)
                put_streams_back(self, name, streams)
                counted = cuda_oom_count(device) > ooms
                error = phase_error(err, name, self.step_index, device, self.memory, undone, counted)
                if error is None:
                    raise
                err.__traceback__ = None
                del err  # why: the traceback's frames hold the failed phase's tensors
                release_memory()
                raise error from None
        finally:
            set_phase(None)
            self._busy.release()

    def _failed(self, phase: str) -> str:
        """A phase failed: undo the step's updates, and file the failed work as an attempt of its own.
        Returns what was put back, for the error message (the executor's word when its ranks lost the step)."""
        import sys

        undone = self.executor.failed(phase, sys.exc_info()[1])
        if undone is not None:  # the executor lost the step (its ranks were stopped): it starts again from its rollout
            self._restart_step()
            return undone
        applied = self._step.snapshot is not None
        undone = "the step's updates were rolled back" if applied else "no update had been applied"
        # (check_order lets no other phase run while updates or gradients are pending, so only these redo the updates)
        self._retire({phase, *UPDATE_PHASES} if phase in UPDATE_PHASES else {phase})
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
    def rollout(self, turns: Optional[int] = None) -> Rollout:
        """Start the step (or restart it, when no update was applied yet) with a fresh rollout; a restart samples
        the step's own prompts again. `turns` (a Lab with tools): run that many more turns and leave the rollout
        pending, returning what each row called and each tool answered; `lab.rollout()` then ends it (turns_api.py)."""
        return rollout_phase(self, turns)

    def rewards(self, rollout: Rollout) -> Rewards:
        return self._kept("rewards", rollout=rollout)

    def advantages(self, rewards: Rewards) -> Advantages:
        return self._kept("advantages", rewards=rewards)

    def logprobs(self, rollout: Rollout) -> LogProbs:
        return self._kept("logprobs", rollout=rollout)

    def backward(self, rollout: Rollout, advantages: Advantages, logprobs: LogProbs) -> LossStats:
        with self._phase("backward", rollout=rollout, advantages=advantages, logprobs=logprobs):
            out = self._compute("backward", rollout, advantages, logprobs)
        s = self._step
        s.stats, s.gradients, s.is_weights = out.stats, True, out.is_weights
        s.old_logprobs = out.old_logprobs if s.old_logprobs is None else s.old_logprobs  # the first backward's
        return out.stats

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
        """A phase's work, by the executor: on this process's models, or on the ranks, drawing from this Lab's own
        random streams; the host guard stops it where host RAM crosses its line (memory/live_guard.py)."""
        own_streams(self)
        return self.memory.guarded(self.executor.compute, name, self._step, *inputs)  # the live host guard

    def _kept(self, name: str, **inputs):
        """Run phase `name` and keep what it returns in the step's state (the registry names the field)."""
        with self._phase(name, **inputs):
            out = self._compute(name, *inputs.values())
        setattr(self._step, BY_NAME[name].output, out)
        return out

    def _finish_step(self) -> StepResult:
        from .memory.leaks import end_of_step

        s = self._step
        result = self.executor.result(s, self.timeline.seconds(s.index))
        result.memory, result.turn_memory = self.memory.rows_for(s.index), self.memory.mark_rows(s.index)
        result.leaks = self.leaks.observe(end_of_step(result.memory))
        self.history.append(result)
        self._step = StepState(index=s.index + 1)  # why: the snapshot goes with the finished step
        self.trackers.log(result)  # after the step is recorded: a tracker's failure is only a warning
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
        self.executor.check_learner()  # why every step: a wrap in a cell spills at once
        return grpo.step(RestOfStep(self), self.config.grpo.num_iterations)

    def rollback(self) -> None:
        """Undo the current step's updates (if any) and drop its gradients; its rollout, rewards,
        advantages and log-probs are kept, so the step goes on from backward."""
        drop_turns(self)  # (and a pending rollout's turns go)
        s = self._step
        self.executor.rollback(s)
        s.snapshot, s.updates, s.gradients, s.stats, s.grad_norm = None, 0, False, None, None
        rewind_streams(self, "backward")  # (the redone backward draws the dropout masks the first drew)

    def run(self, steps: Optional[int] = None) -> list[StepResult]:
        """`steps` steps (default: run.steps, read now)."""
        return [self.step() for _ in range(self.config.run.steps if steps is None else steps)]

    def save_adapter(self, path: Union[str, Path]) -> Path:
        self._require_loaded()
        return self.executor.save_adapter(path)

    def save_checkpoint(self, path: Union[str, Path]) -> Path:
        """Between steps, write what the next step depends on (LoRA adapter, optimizer state, RNG states,
        data position, step index) to `path`, atomically; `restore_checkpoint` (in this Lab or a new one
        with the same config) continues from there, with the same results as going on without a break."""
        self.between_steps("lab.save_checkpoint()")
        own_streams(self)  # why: the checkpoint's RNG states are this Lab's, whatever Lab ran last
        return self.executor.save_checkpoint(path)

    def restore_checkpoint(self, path: Union[str, Path]) -> "Lab":
        """Continue from a checkpoint: its weights, optimizer state, RNG states, data position and step
        index replace this Lab's; the generator is synced to the restored weights."""
        from .recovery.checkpoint import read_checkpoint

        self.between_steps("lab.restore_checkpoint()")
        checkpoint = read_checkpoint(path)  # refused here, in one line, before any model (or rank) reads it
        own_streams(self)  # why: the restored RNG states become this Lab's
        self.executor.restore_checkpoint(checkpoint)
        self.resume_at(checkpoint.step)
        return self

    def resume_at(self, step: int) -> None:
        """Continue at the start of `step` (a restored checkpoint or boundary state)."""
        self._step = StepState(index=step)

    def between_steps(self, what: str) -> None:
        self._require_loaded()
        check_between_steps(self._step, what, self.next_phase())

    # --- failures on demand (the worst-case probe, lab.probe(), is a view: ui/views.py) ---
    def arm_fault(self, rank: int, phase: str, error: str = "oom") -> None:
        """Make rank `rank`'s next `phase` fail once, inside it (recovery/faults.py: 'oom', 'runtime', or 'nan' for a
        backward's loss): how a notebook shows recovery. One process is rank 0."""
        from .recovery.faults import check

        check(phase, error)
        self._require_loaded()
        self.executor.arm_fault(rank, phase, error)

    def close(self) -> None:
        """Stop the sampler, release the generator and models (the Python objects go with the Lab)."""
        self._release()
