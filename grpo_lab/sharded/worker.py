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
import pickle
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch

PER_RANK = {"inspect"}   # commands whose answer differs by rank
STREAM_S = 0.5   # why: the live plot redraws every 0.5 s; a rank's samples arrive as often while a command runs
TIMEOUT_S = 600   # a collective that waits longer than this fails (gloo's default, 30 min, looks like a hang)


def send(conn, message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))   # why plain pickle: tensors by value


def receive(conn):
    return pickle.loads(conn.recv_bytes())


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
    from .world import World, backend_for, rank_devices, set_world

    from transformers.utils import logging as hf_logging

    # why: Jupyter's interrupt and a terminal's Ctrl-C reach the whole process group; a rank stopped on its own would
    # leave the others blocked in a collective and answer the driver's next command with this one's error. The
    # driver decides: it stops every rank and starts them again from their boundary state (driver.Ranks.halt)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    hf_logging.disable_progress_bar()   # why: N ranks' loading bars would interleave on the notebook's stderr
    learner = config["placement"]["learner"]
    torch.set_num_threads(threads)   # why: ranks on one machine's cores must not oversubscribe them (OpenMP)
    device = rank_devices(learner, size)[rank]
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group(backend_for(learner), rank=rank, world_size=size, timeout=timedelta(seconds=TIMEOUT_S))
        set_world(World(rank, size))
        lab = Lab(config).load()
        boundary = Boundary(Path(state_dir), rank)
        if restore is not None:
            boundary.restore(lab, restore)
        else:
            boundary.save(lab)
    except BaseException as err:
        send(conn, ("error", one_line(err), memory_since(None, {})))
        return
    Rank(rank, lab, boundary, conn).serve()


class Rank:
    def __init__(self, rank: int, lab, boundary: "Boundary", conn):
        self.rank, self.lab, self.boundary, self.conn = rank, lab, boundary, conn
        self.sent = {"samples": 0, "rows": 0}
        self.lock, self.busy = threading.Lock(), False   # the pipe's writers: the command loop and the memory stream
        self.fault = None   # (phase, error): raised at that phase's next log-prob pass (tests, notebooks)

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
        with self._armed(name):
            out = getattr(self.lab, name)(*inputs)
        if name == "sync":
            self.boundary.save(self.lab)
        return out

    def rollback(self):
        self.lab.rollback()

    def save_checkpoint(self, path: str):
        from .state import save_full_checkpoint

        save_full_checkpoint(self.lab, path)

    def restore_checkpoint(self, path: str):
        from .state import restore_full_checkpoint

        restore_full_checkpoint(self.lab, path)
        self.boundary.save(self.lab)
        return self.lab.step_index

    def lora_shapes(self) -> dict:
        """Every LoRA parameter's whole shape and dtype (what the driver's vLLM engine sizes its adapter by)."""
        return {n: (tuple(p.shape), p.dtype) for n, p in self.lab.learner.trainable_parameters().items()}

    def save_adapter(self, path: str):
        from .state import save_full_adapter

        save_full_adapter(self.lab, path)

    def inspect(self):
        """What tests and notebooks compare: this rank's LoRA and AdamW shards, and the model's sharding layout."""
        from .fsdp import layout, local

        learner = self.lab.learner
        return {"rank": self.rank,
                "lora": {n: local(p).detach().clone() for n, p in learner.trainable_parameters().items()},
                "optimizer": local_state(learner.optimizer.state_dict()),
                "layout": layout(learner.model), "step": self.lab.step_index}

    def arm_fault(self, phase: str, error: str):
        """Make this rank's next `phase` fail inside it (`error`: 'oom' = torch.OutOfMemoryError, else RuntimeError):
        in backward and logprobs at the first log-prob pass, in rollout at the third decoding step."""
        self.fault = (phase, error)

    @contextmanager
    def _armed(self, name: str):
        if self.fault is None or self.fault[0] != name:
            yield
            return
        _, error = self.fault
        self.fault = None
        with fault_injected(name, error):
            yield


def fault_injected(phase: str, error: str):
    """Patch the function `phase` runs through so that it raises partway."""
    from unittest import mock

    exc = torch.OutOfMemoryError("Tried to allocate 2.00 GiB (injected by lab.arm_fault)") if error == "oom" \
        else RuntimeError(f"injected failure in {phase}")

    @contextmanager
    def patched():
        if phase == "rollout":
            from ..generation import hf

            calls = {"n": 0}
            original = hf.TrimHeapEvery.__call__

            def third_step(self, input_ids, scores):
                calls["n"] += 1
                if calls["n"] == 3:
                    raise exc
                return original(self, input_ids, scores)

            with mock.patch.object(hf.TrimHeapEvery, "__call__", third_step):
                yield
            return
        from .. import step

        with mock.patch.object(step, "completion_logprobs", side_effect=exc):
            yield

    return patched()


def config_changes(mine: dict, theirs: dict) -> dict:
    return {f"{s}.{f}": theirs[s][f] for s in theirs for f in theirs[s] if mine[s][f] != theirs[s][f]}


def one_line(err: BaseException) -> str:
    from ..errors import LabError

    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if isinstance(err, LabError):
        return text
    return f"{type(err).__name__}: {text}" if text else "".join(traceback.format_exception_only(type(err), err)).strip()


def capacities(lab) -> dict:
    from ..memory.report import capacities_of

    return capacities_of(lab.memory)


def memory_since(sampler, sent: dict) -> dict:
    """The samples and per-phase rows taken since the last reply (and advance `sent`)."""
    if sampler is None:
        return {}
    samples = sampler.samples_since(sent["samples"])
    rows = [dict(r) for r in sampler.phase_rows[sent["rows"]:]]
    sent["samples"], sent["rows"] = sampler.total, len(sampler.phase_rows)
    return {"t0": sampler.t0, "samples": samples, "rows": rows}


def local_state(state):
    """An optimizer state dict with every DTensor as its local shard (plain tensors: picklable, comparable)."""
    from .fsdp import local

    if isinstance(state, torch.Tensor):
        return local(state).detach().clone()
    if isinstance(state, dict):
        return {k: local_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(local_state(v) for v in state)
    return state


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
        from ..checkpoint import rng_state
        from ..io import atomic_write_text
        from .fsdp import local

        learner, step = lab.learner, lab.step_index
        state = {"step": step, "rng": rng_state(), "data": lab.prompts.state_dict(),
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
    from ..checkpoint import set_rng_state
    from ..lifecycle import StepState
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
    set_rng_state(state["rng"])
    lab._step = StepState(index=state["step"])


if __name__ == "__main__":
    import sys

    connect(sys.argv[1], int(sys.argv[2]))
