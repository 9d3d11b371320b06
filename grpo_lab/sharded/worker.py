"""A rank of a sharded learner: a process that joins the process group, loads a Lab of its own (the learner
sharded by FSDP2, the same code as one process), and runs the driver's commands one at a time: a phase, a
rollback, a checkpoint. Every reply carries the memory samples and per-phase rows it took since the last one.

At load and after every finished step the rank writes its *boundary state* (its LoRA and AdamW shards, RNG states,
prompt order, step index) to a file of its own. Why: a rank that fails in a phase leaves the others blocked in a
collective, where they can only be killed; the driver then starts every rank afresh from those files.
"""
from __future__ import annotations

import io
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch

from .wire import memory_since, one_line, receive, send

PER_RANK = {"inspect"}   # commands whose answer differs by rank
STREAM_S = 0.5   # why: the live plot redraws every 0.5 s; a rank's samples arrive as often while a command runs
TIMEOUT_S = 600   # a collective that waits longer than this fails (gloo's default, 30 min, looks like a hang)


def connect(address: str, rank: int) -> None:
    """`python -m grpo_lab.sharded.worker ADDRESS RANK`: connect to the driver, take the rank's settings, serve."""
    from multiprocessing.connection import Client

    key = bytes.fromhex(os.environ.pop("GRPO_LAB_RANK_KEY"))
    conn = Client(address, family="AF_UNIX", authkey=key)
    send(conn, rank)
    main(conn, *receive(conn))


def main(conn, rank: int, size: int, port: int, config: dict, state_dir: str, restore: Optional[int],
         threads: int) -> None:
    """`restore`: the step whose boundary state this rank starts from (a restart), or None (a first start)."""
    import signal

    import torch.distributed as dist

    from ..lab import Lab
    from ..runtime import Runtime, init_decisions, runtime, set_runtime
    from .world import backend_for

    from transformers.utils import logging as hf_logging

    # why: Jupyter's interrupt and a terminal's Ctrl-C reach the whole process group; a rank stopped on its own would
    # leave the others blocked in a collective and answer the driver's next command with this one's error. The
    # driver decides: it stops every rank and starts them again from their boundary state (ranks.Ranks.halt)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    hf_logging.disable_progress_bar()   # why: N ranks' loading bars would interleave on the notebook's stderr
    learner = config["placement"]["learner"]
    torch.set_num_threads(threads)   # why: ranks on one machine's cores must not oversubscribe them (OpenMP)
    set_runtime(Runtime(rank, size, is_rank=True))   # why first: from here on, "which device am I" is this rank's
    device = runtime().device_of(learner)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group(backend_for(learner), rank=rank, world_size=size, timeout=timedelta(seconds=TIMEOUT_S))
        init_decisions()   # the group every cross-rank decision is agreed on (runtime.agree)
        lab = Lab(config).load()
        boundary = Boundary(Path(state_dir), rank)
        if restore is not None:
            boundary.restore(lab, restore)
        else:
            boundary.save(lab)
    except BaseException as err:
        send(conn, ("error", one_line(err), memory_since(None, {})))
        return
    RankServer(rank, lab, boundary, conn).serve()


class RankServer:
    """This rank's end of the driver's pipe: it runs each command on the rank's own Lab."""

    def __init__(self, rank: int, lab, boundary: "Boundary", conn):
        self.rank, self.lab, self.boundary, self.conn = rank, lab, boundary, conn
        self.sent = {"samples": 0, "rows": 0}
        self.lock, self.busy = threading.Lock(), False   # the pipe's writers: the command loop and the memory stream

    def serve(self) -> None:
        from .remote import serve_questions_on

        send(self.conn, ("ready", {"t0": self.lab.memory.t0, "capacities": capacities(self.lab)}, self.memory()))
        threading.Thread(target=self._stream, daemon=True, name="grpo-lab-rank-memory").start()
        while True:
            try:
                command, args = receive(self.conn)
            except EOFError:   # the driver is gone
                return
            if command == "close":
                self.lab.close()
                send(self.conn, ("ok", None, {}))
                return
            serve_questions_on(self)
            self.busy = True
            try:
                out = getattr(self, command)(*args)
                mine = self.rank == 0 or command in PER_RANK   # why: the others' copies are equal; no need to ship them
                reply = ("ok", out if mine else None)
            except BaseException as err:   # why so broad: the rank must answer, whatever happened
                reply = ("error", one_line(err))
            with self.lock:   # why together: no memory message may follow the reply (the driver stops reading)
                self.busy = False
                send(self.conn, (*reply, self.memory()))

    def send(self, message) -> None:
        """Send on the driver's pipe, which the memory stream also writes to."""
        with self.lock:
            send(self.conn, message)

    def _stream(self) -> None:
        """While a command runs, send the memory samples taken so far every STREAM_S: the driver's live plot and
        sampler see each rank during a long phase, not only at its end."""
        while True:
            time.sleep(STREAM_S)
            with self.lock:
                if self.busy:
                    delta = self.memory()
                    if delta["samples"] or delta["rows"]:
                        try:
                            send(self.conn, ("memory", delta))
                        except OSError:   # the driver is gone
                            return

    def memory(self) -> dict:
        return memory_since(self.lab.memory, self.sent)

    # --- commands ---
    def phase(self, name: str, config: dict):
        """Run this step's phase `name` with this rank's own outputs of the phases before it."""
        from ..phases import BY_NAME

        changes = config_changes(self.lab.config.to_dict(), config)
        if changes:
            self.lab.config.update(changes)   # the driver's edits, checked and rebuilt here as in one process
        inputs = [getattr(self.lab.current, field) for field in BY_NAME[name].inputs]
        out = getattr(self.lab, name)(*inputs)
        if name == "sync":
            self.boundary.save(self.lab)
        return out

    def rollback(self):
        self.lab.rollback()

    def save_checkpoint(self, path: str):
        self.lab.save_checkpoint(path)   # the rank's Lab gathers (runtime: a rank); rank 0 writes

    def restore_checkpoint(self, path: str):
        self.lab.restore_checkpoint(path)
        self.boundary.save(self.lab)
        return self.lab.step_index

    def lora_shapes(self) -> dict:
        """Every LoRA parameter's whole shape and dtype (what the driver's vLLM engine sizes its adapter by)."""
        return {n: (tuple(p.shape), p.dtype) for n, p in self.lab.learner.trainable_parameters().items()}

    def save_adapter(self, path: str):
        self.lab.save_adapter(path)

    def inspect(self):
        """What tests and notebooks compare: this rank's LoRA and AdamW shards, and the model's sharding layout."""
        return self.lab.inspect()[0]

    def arm_fault(self, phase: str, error: str):
        """Make this rank's next `phase` fail inside it (faults.py)."""
        self.lab.arm_fault(self.rank, phase, error)


def config_changes(mine: dict, theirs: dict) -> dict:
    return {f"{s}.{f}": theirs[s][f] for s in theirs for f in theirs[s] if mine[s][f] != theirs[s][f]}


def capacities(lab) -> dict:
    from ..memory.report import capacities_of

    return capacities_of(lab.memory)


class Boundary:
    """This rank's boundary states, one file per step start: `rank<k>-step<N>.pt`. Why per step: the driver
    restarts the ranks from the step *it* is at, and a rank may have written the next step's state (at the end of
    sync) before the driver read its reply (an interrupt in between). The last two steps are kept."""

    def __init__(self, folder: Path, rank: int):
        self.folder, self.rank = folder, rank

    def path(self, step: int) -> Path:
        return self.folder / f"rank{self.rank}-step{step}.pt"

    def save(self, lab) -> None:
        """This rank's state between steps (its shards only: no collective), written atomically."""
        from ..io import atomic_write_text
        from ..runtime import capture_rng, runtime
        from .fsdp import local, local_state

        learner, step = lab.learner, lab.step_index
        rng = capture_rng(runtime().cuda_indices(lab.config))   # this rank's own streams (its GPU's, not every GPU's)
        state = {"step": step, "rng": rng, "data": lab.prompts.state_dict(),
                 "lora": {n: local(p).detach().cpu().clone() for n, p in learner.trainable_parameters().items()},
                 "optimizer": local_state(learner.optimizer.state_dict())}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        atomic_write_text(self.path(step), buffer.getvalue())
        for old in self.folder.glob(f"rank{self.rank}-step*.pt"):
            if old not in (self.path(step), self.path(step - 1)):
                old.unlink(missing_ok=True)

    def restore(self, lab, step: int) -> None:
        """Put this rank's state at the start of `step` back into a freshly loaded Lab (a restart)."""
        restore_boundary(lab, self.path(step))


def restore_boundary(lab, path: Path) -> None:
    from ..runtime import restore_rng
    from .fsdp import local
    from .state import load_optimizer_shards

    if not path.exists():
        raise FileNotFoundError(f"no boundary state {path.name}: this rank never reached that step's start")
    state = torch.load(path, map_location="cpu", weights_only=False)
    learner = lab.learner
    with torch.no_grad():
        for name, p in learner.trainable_parameters().items():
            local(p).copy_(state["lora"][name])
    load_optimizer_shards(learner, state["optimizer"])
    lab.prompts.load_state_dict(state["data"])
    restore_rng(state["rng"])
    lab._resume_at(state["step"])


if __name__ == "__main__":
    import sys

    connect(sys.argv[1], int(sys.argv[2]))
