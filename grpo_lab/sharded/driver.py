"""`ShardedLab`: a Lab whose learner is sharded over `placement.learner_procs` worker processes (worker.py).
`Lab(config)` returns one when learner_procs > 1. It keeps the notebook's API and lifecycle (the same phase
methods, `step()`, config edits, history, memory views); each phase is one command to every rank, the results
come back from rank 0 (every rank computes the same rollout, rewards and advantages; log-probs and backward are
each rank's rows, gathered), and every rank's samples and per-phase rows join the driver's memory sampler under
'rank<k>/<device>'.

A phase that fails on every rank is undone on each as in one process. A phase that fails on some ranks only
(an out-of-memory error on rank 1 in backward, a rank killed) leaves the others blocked in a collective: every
rank is then stopped and started again from its boundary state, the one it wrote when the step began, so the
LoRA weights and AdamW state are bit for bit those before the step, and the step runs again from its rollout.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Callable, Optional

from ..errors import LabError
from ..knobs import REBUILDS, LoadedLabGuard
from ..lab import Lab, preflight
from ..lifecycle import StepState
from ..memory.sampler import MemorySampler
from ..phases import PHASE_NAMES
from .remote import Answers
from .worker import receive, send

START_TIMEOUT_S = 900   # loading a model on every rank
# why: the machine's used RAM and its limit read the same from every process; the driver's own host sampler has
# them (and its guard stops on them), so a rank sends only what is its own (RSS, its GPU)
MACHINE_WIDE = {("host", "used"), ("host", "limit")}
GRACE_S = 10            # after one rank fails, how long the others get to answer before they are presumed blocked


class RankFailure(LabError):
    """A phase failed on some ranks; `restarted` says whether every rank was started afresh from its boundary state."""

    def __init__(self, message: str, restarted: bool):
        super().__init__(message)
        self.restarted = restarted


class RankMemory(MemorySampler):
    """The driver's own sampler (its host memory, and its vLLM engine's GPUs), plus every rank's samples and
    per-phase rows as they arrive."""

    def __init__(self, devices: list[str], *args, **kwargs):
        super().__init__(devices, *args, **kwargs)
        self.rank_capacities: dict[str, float] = {}
        self.streamed = 0   # messages that arrived while a command ran

    def ingest(self, rank: int, delta: dict, live: bool = False) -> None:
        """A rank's samples and per-phase rows since its last message (`live`: sent while its command ran)."""
        if not delta:
            return
        self.streamed += live
        shift = delta["t0"] - self.t0   # perf_counter is one clock for every process of this machine
        label = lambda device: f"rank{rank}/{device}"
        samples = [s for s in delta["samples"] if (s[3], s[4]) not in MACHINE_WIDE]
        with self._lock:
            for t, step, phase, device, metric, value in samples:
                self.samples.append((t + shift, step, phase, label(device), metric, value))
            self.total += len(samples)
            self.phase_rows.extend({**row, "device": label(row["device"])} for row in delta["rows"]
                                   if (row["device"], row["metric"]) not in MACHINE_WIDE)


class Ranks:
    """The worker processes, one per rank, and the pipe to each. `step()` is the step the driver is at (the ranks
    start again from its boundary state); `stopped()` is called whenever the ranks lose the step's progress."""

    def __init__(self, config: dict, size: int, memory: RankMemory, step: Callable[[], int] = lambda: 0,
                 stopped: Callable[[], None] = lambda: None):
        from .world import usable_cpus

        self.config, self.size, self.memory, self.step, self.stopped = config, size, memory, step, stopped
        self.down = False   # stopped by halt(): started again, from the driver's step, at the next command
        self.state_dir = tempfile.mkdtemp(prefix="grpo-lab-ranks-")
        self.threads = max(1, usable_cpus() // size) if config["placement"]["learner"] == "cpu" else 1
        self.procs: list = []
        self.conns: list = []
        self.key = os.urandom(32)
        self.answers = Answers(None)   # what the ranks may ask mid-command: the driver's vLLM engine, if any

    def start(self, restore: Optional[int] = None) -> "Ranks":
        """Start every rank: loaded afresh, or (`restore`, a step index) from its state at that step's start."""
        try:
            return self._start(restore)
        except BaseException:   # an interrupt or a failed rank: no process may outlive the start
            self.kill()
            raise

    def _start(self, restore: Optional[int]) -> "Ranks":
        # why fresh interpreters (not fork, not multiprocessing's spawn): a forked CUDA or OpenMP runtime is unusable
        # in the child, and spawn re-runs the user's script in every rank unless it has a __main__ guard
        from multiprocessing.connection import Listener

        port = _free_port()
        with Listener(family="AF_UNIX", authkey=self.key) as listener:
            for rank in range(self.size):
                self.procs.append(Rank(subprocess.Popen([sys.executable, "-m", "grpo_lab.sharded.worker",
                                                         listener.address, str(rank)], env=_child_env(self.key))))
            for rank in range(self.size):
                conn = _accept(listener, self.procs, START_TIMEOUT_S)
                self.conns.append(conn)
            ordered = [None] * self.size
            for conn in self.conns:
                ordered[receive(conn)] = conn   # each rank says who it is first
            self.conns = ordered
        for rank, conn in enumerate(self.conns):
            send(conn, (rank, self.size, port, self.config, self.state_dir, restore, self.threads))
        replies = self._collect(START_TIMEOUT_S)
        failed = {rank: r for rank, r in replies.items() if r[0] != "ready"}
        if failed or len(replies) < self.size:
            rank, reply = min(failed.items()) if failed else (min(set(range(self.size)) - set(replies)), None)
            raise LabError(f"rank {rank} did not start: {reply[1] if reply else 'no answer'}")
        for rank, (_, info, delta) in replies.items():
            self.memory.ingest(rank, delta)
            self.memory.rank_capacities.update({f"rank{rank}/{d}": c for d, c in info["capacities"].items()})
        return self

    def call(self, command: str, *args, describe: str = ""):
        """Run `command` on every rank; rank 0's result. A failure raises RankFailure (one line naming the rank)."""
        with self.exchange():
            self.answers.clear()
            for conn in self.conns:
                send(conn, (command, args))
            replies = self._collect(None)
        errors = {rank: r[1] for rank, r in replies.items() if r[0] != "ok"}
        for rank, reply in replies.items():
            self.memory.ingest(rank, reply[2])
        if not errors and len(replies) == self.size:
            return replies[0][1]
        first = min(errors) if errors else min(set(range(self.size)) - set(replies))
        what = errors.get(first, "did not answer (blocked or killed)")
        everywhere = len(errors) == self.size and len(set(errors.values())) == 1
        if len(errors) == self.size:   # every rank answered: each undid its own work, and their collectives agree
            where = "every rank" if everywhere else f"rank {first}"
            raise RankFailure(f"{describe or command} failed on {where}: {what}", restarted=False)
        self.restart()
        raise RankFailure(f"{describe or command} failed on rank {first}: {what}; the other ranks could not finish it, "
                          "so every rank was restarted from the state it had when this step began (LoRA, AdamW, RNG, "
                          "prompt order); lab.step() runs the step again from its rollout", restarted=True)

    def _collect(self, timeout: Optional[float]) -> dict:
        """Replies by rank; after the first error, the others get GRACE_S more (a blocked rank never answers)."""
        from multiprocessing.connection import wait

        replies: dict = {}
        deadline = float("inf") if timeout is None else time.monotonic() + timeout
        graced = False
        pending = dict(enumerate(self.conns))
        while pending:
            if not graced and any(r[0] == "error" for r in replies.values()):
                deadline, graced = min(deadline, time.monotonic() + GRACE_S), True
            left = None if deadline == float("inf") else max(deadline - time.monotonic(), 0)
            sentinels = {self.procs[rank].sentinel: rank for rank in pending}
            ready = wait([*pending.values(), *sentinels], left)
            if not ready:
                break
            for item in ready:
                rank = sentinels.get(item)
                if rank is None:
                    rank = next(r for r, c in pending.items() if c is item)
                    try:
                        message = receive(item)
                    except EOFError:
                        message = ("error", f"its process died (exit code {self.procs[rank].exitcode})", {})
                    if message[0] == "ask":   # a question mid-command (the generator's): answer, keep waiting
                        send(item, self.answers.answer(*message[1:]))
                        continue
                    if message[0] == "memory":   # the rank's samples so far, mid-command: for the live plot
                        self.memory.ingest(rank, message[1], live=True)
                        continue
                    replies[rank] = message
                elif rank in pending and not pending[rank].poll():
                    code = self.procs[rank].exitcode
                    why = " (killed: out of host memory?)" if code == -9 else ""
                    replies[rank] = ("error", f"its process died (exit code {code}{why})", {})
                else:
                    continue   # it died after answering: the answer is read from its pipe next
                pending.pop(rank, None)
        return replies

    def each(self, command: str, *args) -> list:
        """Run `command` on every rank; each rank's (status, value), its memory samples ingested."""
        with self.exchange():
            for conn in self.conns:
                send(conn, (command, args))
            replies = [self.reply(rank) for rank in range(self.size)]
        for rank, (_, _, delta) in enumerate(replies):
            self.memory.ingest(rank, delta)
        return [reply[:2] for reply in replies]

    def one(self, rank: int, command: str, *args):
        """Run `command` on rank `rank` alone; its (status, value)."""
        with self.exchange():
            send(self.conns[rank], (command, args))
            status, value, delta = self.reply(rank)
        self.memory.ingest(rank, delta)
        return status, value

    def reply(self, rank: int):
        """Rank `rank`'s reply to a command sent to it alone, its memory samples on the way ingested."""
        while True:
            message = receive(self.conns[rank])
            if message[0] != "memory":
                return message
            self.memory.ingest(rank, message[1], live=True)

    @contextmanager
    def exchange(self):
        """Commands out, replies in. Anything that stops the driver in between (an interrupt, an error of its own)
        leaves replies unread that would answer its next command, and ranks that may be blocked in a collective:
        every rank is then stopped (halt), and the next command starts them from the driver's step."""
        self.up()
        try:
            yield
        except BaseException:
            self.halt()
            raise

    def up(self) -> None:
        """Start the ranks again if halt() stopped them, each from its state at the driver's step's start."""
        if self.down:
            self.start(restore=self.step())
            self.down = False

    def halt(self) -> None:
        self.kill()
        self.down = True
        self.stopped()

    def restart(self) -> None:
        self.halt()
        self.up()

    def kill(self) -> None:
        for proc in self.procs:
            proc.kill()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def close(self) -> None:
        for conn in self.conns:
            try:
                send(conn, ("close", ()))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 60
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0.1))
        self.kill()
        shutil.rmtree(self.state_dir, ignore_errors=True)


class Rank:
    """A rank's process: `sentinel` (a pidfd) becomes readable when it exits."""

    def __init__(self, popen):
        self.popen = popen
        self.sentinel = os.pidfd_open(popen.pid)

    @property
    def exitcode(self):
        return self.popen.poll()

    def join(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        os.close(self.sentinel)


def _accept(listener, procs: list, timeout: float):
    """The next rank's connection, or a one-line error if a rank died or none came within `timeout`."""
    import threading

    box: list = []
    thread = threading.Thread(target=lambda: box.append(listener.accept()), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(0.2)
        dead = [k for k, p in enumerate(procs) if p.exitcode is not None]
        if dead and not box:
            for p in procs:
                p.kill()
            raise LabError(f"rank {dead[0]} did not start: its process exited with code {procs[dead[0]].exitcode} "
                           "before connecting (its error is above, on stderr)")
    if not box:
        for p in procs:
            p.kill()
        raise LabError(f"the ranks did not connect within {timeout:.0f} s; see their errors above, on stderr")
    return box[0]


def _child_env(key: bytes) -> dict:
    env = dict(os.environ, GRPO_LAB_RANK_KEY=key.hex())   # why the environment: never on a command line (ps shows it)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankAdapter:
    """The sharded learner as the driver's vLLM generator sees a learner: its tokenizer, its LoRA parameters' sizes
    and `model.save_pretrained(path)`, which gathers the LoRA tensors from every rank (never the base) into a PEFT
    adapter that the engine loads."""

    def __init__(self, lab: "ShardedLab"):
        from ..learner import load_tokenizer
        from ..tiny import resolve_model_path

        self.lab, self.model = lab, self
        self.tokenizer = load_tokenizer(resolve_model_path(lab.config.model.name_or_path))

    def trainable_parameters(self) -> dict:
        import torch

        shapes = self.lab.ranks.call("lora_shapes", describe="lora_shapes")
        return {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shapes.items()}

    def save_pretrained(self, path) -> None:
        self.lab.ranks.call("save_adapter", str(path), describe="the generator's LoRA sync")


class ShardedGuard(LoadedLabGuard):
    """Edits of a loaded ShardedLab: refused here as in one process; applied on every rank at its next command."""

    def check(self, config, new, changed: dict) -> None:
        lab, generator = self.lab, self.lab.generator
        self.lab.generator = generator or _AcceptsEdits()   # the driver's engine, or the ranks' hf generators
        try:
            super().check(config, new, changed)
        finally:
            lab.generator = generator

    def apply(self, config, changed: dict) -> None:
        for path in changed:   # the driver's own part: its sampler and leak detector
            if path.startswith("memory.") and path in REBUILDS:
                REBUILDS[path](self.lab)


class _AcceptsEdits:
    def check_live(self, config) -> None:
        pass


class ShardedLab(Lab):
    """A Lab over `placement.learner_procs` ranks (see the module docstring)."""

    ranks: Optional[Ranks] = None

    def _load(self) -> "ShardedLab":
        from ..memory import LeakDetector
        from ..trackers import Trackers

        cfg = self.config
        preflight(cfg)
        if self.reward_funcs_given:
            raise LabError("reward_funcs: a sharded Lab's ranks are processes of their own and cannot take functions "
                           "from this one; name them in data.rewards ('module:function')")
        self.memory_devices = [cfg.placement.learner]
        engine_gpus = [d for d in cfg.placement.generator_devices() if d != "cpu"] if self._own_engine else []
        self.memory = RankMemory(["cpu", *engine_gpus], cfg.memory.sample_hz, cfg.memory.host_threshold).start()
        self.timeline.listeners.append(self.memory)
        self.leaks = LeakDetector(cfg.memory.leak_window, cfg.memory.leak_min_growth_mib * 1024 ** 2)
        rank_config = cfg.to_dict()
        rank_config["run"]["report_to"] = []   # the driver reports; the ranks compute
        self.ranks = Ranks(rank_config, cfg.placement.learner_procs, self.memory, step=lambda: self.step_index,
                           stopped=self._ranks_stopped).start()
        self.learner = self.ranks   # why: "loaded" means the ranks are up
        if self._own_engine:   # the ranks' one engine, here: it starts with their adapter, gathered
            from ..generation import backend_class

            try:
                self._adapter = RankAdapter(self)
                self.generator = backend_class(cfg.generator.backend)(self._adapter, cfg)
            except BaseException:
                self.ranks.close()
                raise
            self.ranks.answers.service = self.generator
        self.trackers = Trackers(cfg)
        cfg._guard = ShardedGuard(self)
        return self

    @property
    def _own_engine(self) -> bool:
        """A generator with weights of its own (vLLM) runs in this process, for every rank (sharded/remote.py)."""
        from ..generation.registry import OWN_WEIGHTS

        return self.config.generator.backend in OWN_WEIGHTS

    @property
    def _on_cuda(self) -> bool:
        return False   # the driver computes nothing; each rank marks its own phases

    def devices(self) -> list[str]:
        from .world import rank_devices

        return [f"rank{k}/{d}" for k, d in enumerate(rank_devices(self.config.placement.learner,
                                                                  self.config.placement.learner_procs))]

    def _check_learner(self) -> None:
        pass   # each rank's learner is checked by its own Lab at load

    def _compute(self, name: str, *inputs):
        """Every rank runs the phase with its own inputs (the same as these: the rollout is computed on every rank)."""
        if self.generator is not None and (name == "sync" or (name == "rollout" and self._generator_behind)):
            self.generator.sync(self._adapter)   # the engine's LoRA from the ranks, before they end the step
            self._generator_behind = False
        out = self.ranks.call("phase", name, self.config.to_dict(), describe=name)
        if name == "optimizer" and self._step.snapshot is None:
            self._step.snapshot = "on every rank"   # why: each rank took its own rollback snapshot
        if name == "sync":
            self._rank_result = out
        return out

    _ranks_lost_the_step = False   # the ranks were stopped or restarted: they are (or start) at the step's start

    def _ranks_stopped(self) -> None:
        self._ranks_lost_the_step = True

    def _back_to_step_start(self) -> bool:
        """If the ranks lost the step's progress, put the driver's step back to its start too; whether it did."""
        if not self._ranks_lost_the_step:
            return False
        self._ranks_lost_the_step = False
        self._retire(PHASE_NAMES)
        self._step = StepState(index=self.step_index, attempts=self._step.attempts)
        self._generator_behind = self.generator is not None   # the engine may hold an adapter the ranks undid
        return True

    def _require_loaded(self) -> None:
        super()._require_loaded()
        self._back_to_step_start()   # e.g. an interrupted lab.inspect(): the next command starts from the step
        self.ranks.up()

    def _failed(self, phase: str) -> str:
        import sys

        err = sys.exc_info()[1]
        if not self._back_to_step_start():
            return super()._failed(phase)
        if isinstance(err, RankFailure):
            return "every rank was restarted from the state before the step"
        stopped = (f"{phase} was stopped on every rank (a rank cannot be interrupted alone: the others would wait "
                   "for it); the next command starts them from their state when this step began, and lab.step() "
                   "runs the step again from its rollout")
        if isinstance(err, BaseException):
            err.add_note(f"every rank was stopped: {stopped}")
        return stopped

    def rollback(self) -> None:
        s = self._step
        if self.ranks is not None and (s.snapshot is not None or s.gradients):
            self.ranks.call("rollback", describe="rollback")
        s.snapshot, s.updates, s.gradients, s.stats, s.grad_norm = None, 0, False, None, None

    def _finish_step(self):
        """Rank 0's result, with the driver's phase times and every rank's memory rows."""
        from ..memory.leaks import end_of_step

        s, result = self._step, self._rank_result
        result.phase_seconds = self.timeline.seconds(s.index)
        result.step_seconds = sum(result.phase_seconds.values())
        result.sync_seconds = result.phase_seconds.get("sync", 0.0)
        result.attempts = s.attempts
        result.memory = self.memory.rows_for(s.index)
        result.leaks = self.leaks.observe(end_of_step(result.memory))
        self.history.append(result)
        self._step = StepState(index=s.index + 1)
        self.trackers.log(result)
        return result

    # --- rank-wide operations ---
    def inspect(self) -> list[dict]:
        """Each rank's LoRA and AdamW shards, step index and sharding layout (for comparisons and tests)."""
        return self._each("inspect")

    def arm_fault(self, rank: int, phase: str, error: str = "oom") -> None:
        """Make rank `rank`'s next `phase` fail partway (error 'oom' or 'runtime'): how a notebook shows recovery."""
        if not 0 <= rank < self.config.placement.learner_procs:
            raise LabError(f"arm_fault: rank {rank} does not exist; ranks are 0..{self.config.placement.learner_procs - 1}")
        if phase not in ("rollout", "logprobs", "backward"):
            raise LabError(f"arm_fault: phase {phase!r}; faults go into rollout, logprobs or backward")
        if phase == "rollout" and self._own_engine:
            raise LabError(f"arm_fault: a rollout fault goes into a rank's hf decoding; with generator.backend: "
                           f"{self.config.generator.backend} the driver's engine samples; arm logprobs or backward")
        self._require_loaded()
        self.ranks.one(rank, "arm_fault", phase, error)

    def _each(self, command: str, *args) -> list:
        self._require_loaded()
        out = []
        for rank, (status, value) in enumerate(self.ranks.each(command, *args)):
            if status != "ok":
                raise LabError(f"{command} failed on rank {rank}: {value}")
            out.append(value)
        return out

    def save_adapter(self, path):
        from pathlib import Path

        self._require_loaded()
        self.ranks.call("save_adapter", str(path), describe="save_adapter")
        return Path(path)

    def save_checkpoint(self, path):
        from pathlib import Path

        self._between_steps("lab.save_checkpoint()")
        self.ranks.call("save_checkpoint", str(path), describe="save_checkpoint")
        return Path(path)

    def restore_checkpoint(self, path) -> "ShardedLab":
        from ..checkpoint import read_checkpoint

        self._between_steps("lab.restore_checkpoint()")
        checkpoint = read_checkpoint(path)   # refused here, in one line, before any rank reads it
        self.ranks.call("restore_checkpoint", str(checkpoint.path), describe="restore_checkpoint")
        self._step = StepState(index=checkpoint.step)
        self._generator_behind = self.generator is not None
        return self

    def _release(self) -> None:
        for plot in self._plots:
            plot.stop()
        if self.memory is not None:
            self.memory.stop()
        if self.generator is not None:
            self.generator.close()
        if self.ranks is not None:
            self.ranks.close()
        if self.trackers is not None:
            self.trackers.close()
        self.learner = self.ranks = self.trackers = self.generator = None
        self._config._guard = None
