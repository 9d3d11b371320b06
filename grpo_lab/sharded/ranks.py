"""A sharded learner's rank processes, as the driver runs them: started as fresh interpreters (worker.py), one pipe
each, every reply collected with the memory samples it carries; a rank that fails where the others cannot follow
(killed, or blocked in a collective) gets every rank stopped and started again from its boundary state.
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
from ..memory.sampler import MemorySampler
from .remote import Answers
from .wire import receive, send
from .world import usable_cpus

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
                self.procs.append(RankProcess(subprocess.Popen([sys.executable, "-m", "grpo_lab.sharded.worker",
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


class RankProcess:
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
