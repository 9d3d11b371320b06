"""A rank of a sharded learner: the body of a Ray actor (execution/sharded/ranks.py wraps it, naming this module by
import path: an entry point, above the Lab it runs, beside the runner). It joins the process group, loads a
Lab of its own (the learner sharded by FSDP2, the same code as one process), and runs the driver's commands one at a
time: a phase, a rollback, a checkpoint. Every reply carries the memory samples and per-phase rows it took since the
last one; while a command runs, the driver polls the rank (`poll`, on a thread of its own) for the samples so far and
for any question its generator asks (execution/sharded/remote.py).

The rank opens no dataset: the driver draws each step's prompt rows and hands them over with the rollout (its Lab's
prompts are data.prompts.HandedPrompts), and the data position is the driver's.

At load and after every finished step the rank returns its *boundary state* (its LoRA and AdamW shards, RNG states,
step index) as bytes, which Ray keeps in its object store for the driver. Why: a rank that fails in a
phase leaves the others blocked in a collective, where they can only be killed; the driver then starts every rank
afresh from those states. Why the object store, not files: the driver owns them, so they outlive a killed rank and
go with the driver; nothing is left on any machine's disk.
"""

from __future__ import annotations

import io
import os
import threading
from datetime import timedelta
from typing import Optional

import torch

from .execution.sharded.wire import memory_since, one_line

PER_RANK = {"inspect"}  # commands whose answer differs by rank
TIMEOUT_S = 600  # a collective that waits longer than this fails (gloo's default, 30 min, looks like a hang)


class RankWorker:
    """This rank's Lab and the commands the driver runs on it (see the module docstring)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.lab = None
        self.sent = {"samples": 0, "rows": 0}
        self.lock = threading.Lock()  # the memory cursor: read by the command thread and the poll thread
        self.questions: dict[int, tuple] = {}  # asked by this rank's generator, not yet answered (sharded/remote.py)
        self.answers: dict[int, tuple] = {}
        self.answered = threading.Condition()

    def address(self) -> tuple[str, int]:
        """This rank's node address (as Ray knows it) and a free port there: rank 0's is the process group's master."""
        import socket

        import ray

        me = ray.get_runtime_context().get_node_id()
        host = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == me)
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def start(self, master: tuple, config: dict, restore: Optional[bytes], threads: int, tools: Optional[dict] = None):
        """Join the group and load; `restore`: the boundary state this rank starts from (a restart), or None; `tools`:
        the driver's tools as a rank holds them, their schemas (execution/sharded/driven.py; None: none): the driver
        runs them. Returns (the reply, the boundary state at load, or None after a restore)."""
        import torch.distributed as dist
        from transformers.utils import logging as hf_logging

        from .checks.world import backend_for
        from .execution.sharded.rank_guard import cap_rank_gpu
        from .lab import Lab
        from .runtime import Runtime, init_decisions, runtime, set_runtime

        hf_logging.disable_progress_bar()  # why: N ranks' loading bars would interleave on the driver's stderr
        learner = config["placement"]["learner"]
        torch.set_num_threads(threads)  # why: ranks on one machine's cores must not oversubscribe them (OpenMP)
        # why first: from here on, "which device am I" is this rank's; Ray gave it one GPU, its cuda:0
        set_runtime(Runtime(self.rank, self.size, is_rank=True, own_gpu=learner != "cpu"))
        device = runtime().device_of(learner)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        try:
            # why before any weight: every allocation of this rank is held to its budget
            cap = cap_rank_gpu(config["placement"].get("rank_memory_gib"), device)
            dist.init_process_group(
                backend_for(learner),
                init_method=f"tcp://{master[0]}:{master[1]}",
                rank=self.rank,
                world_size=self.size,
                timeout=timedelta(seconds=TIMEOUT_S),
            )
            init_decisions()  # the group every cross-rank decision is agreed on (runtime.agree)
            self.lab = Lab(config, tools=tools)  # (the driver's tools as a rank holds them: execution/contract.TOOLS)
            self.lab.load()
            if restore is not None:
                restore_boundary(self.lab, restore)
            state = None if restore is not None else boundary_state(self.lab)
        except BaseException as err:  # why so broad: the driver needs one line, not a remote traceback
            return ("error", one_line(err), self.memory()), None
        import ray

        from .memory.report import capacities_of

        info = {
            "capacities": {**capacities_of(self.lab.memory), **({device: cap} if cap else {})},
            "step": self.lab.step_index,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
        }
        return ("ready", info, self.memory()), state

    def run(self, command: str, args: tuple):
        """Run `command`; returns (status, value, memory, notes) and the boundary state it wrote (after sync), or
        None. notes: {"boundary": the step that state starts, "blocked": whether the others are left in a
        collective}."""
        from .execution.sharded.remote import serve_questions_on

        serve_questions_on(self)
        from .runtime import PeerFailed, take_blocked

        notes = {"boundary": None, "blocked": False, "peer": False}
        try:
            out, state = getattr(self, command)(*args)
            mine = self.rank == 0 or command in PER_RANK  # why: the others' copies are equal; no need to ship them
            status, value = "ok", out if mine else None
            notes["boundary"] = None if state is None else self.lab.step_index
        except BaseException as err:  # why so broad: the rank must answer, whatever happened
            status, value, state = "error", one_line(err), None
            notes["peer"] = isinstance(err, PeerFailed)  # another rank's failure: the driver names that rank's

        # why: a rank that failed where the others could not follow leaves them blocked in a collective; only the
        # driver, told here, can get them out (it restarts every rank)
        notes["blocked"] = take_blocked()
        return (status, value, self.memory(), notes), state

    def poll(self) -> tuple[dict, dict]:
        """Mid-command (its own thread): the memory samples since the last look, and the questions waiting."""
        with self.answered:
            return self.memory(), dict(self.questions)

    def answer(self, number: int, reply: tuple) -> None:
        with self.answered:
            if self.questions.pop(number, None) is not None:  # why: a late duplicate must not answer a later question
                self.answers[number] = reply
                self.answered.notify_all()

    def ask(self, number: int, question: tuple) -> tuple:
        """Called by this rank's generator (sharded/remote.py): wait until the driver answers question `number`."""
        with self.answered:
            self.questions[number] = question
            self.answered.wait_for(lambda: number in self.answers)
            return self.answers.pop(number)

    def memory(self) -> dict:
        with self.lock:
            return memory_since(self.lab.memory if self.lab is not None else None, self.sent)

    def close(self) -> None:
        if self.lab is not None:
            self.lab.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    # --- commands: each returns (result, boundary state or None) ---
    def phase(
        self,
        name: str,
        config: dict,
        scores: Optional[list] = None,
        drawn: Optional[tuple] = None,
        tools: Optional[dict] = None,
    ):
        """Run this step's phase `name` with this rank's own outputs of the phases before it; `scores`: the reward
        models' scores of the rollout, which the driver computed (rewards); `drawn`: the step's prompt rows and
        their epoch, which the driver drew (rollout); `tools`: the driver's environments' copies and get_reward
        scores (rewards; execution/sharded/driven.py)."""
        from .algo.phases import BY_NAME

        changes = config_changes(self.lab.config.to_dict(), config)
        if changes:
            self.lab.config.update(changes)  # the driver's edits, checked and rebuilt here as in one process
        if scores is not None:
            self.lab.executor.take_scores(scores)
        if drawn is not None:
            self.lab.prompts.hand(*drawn)
        if tools is not None:
            self.lab.executor.tools.take(tools, self.lab.current.rollout)
        inputs = [getattr(self.lab.current, field) for field in BY_NAME[name].inputs]
        out = getattr(self.lab, name)(*inputs)
        return out, boundary_state(self.lab) if name == "sync" else None

    def rollback(self):
        return self.lab.rollback(), None

    def save_checkpoint(self, path: str, data: dict):
        self.lab.prompts.load_state_dict(data)  # the driver's data position, which rank 0 writes
        return self.lab.save_checkpoint(path), None  # the rank's Lab gathers (runtime: a rank); rank 0 writes

    def restore_checkpoint(self, path: str):
        self.lab.restore_checkpoint(path)
        return self.lab.step_index, boundary_state(self.lab)

    def lora_shapes(self):
        """Every LoRA parameter's whole shape and dtype (what the driver's vLLM engine sizes its adapter by)."""
        return {n: (tuple(p.shape), p.dtype) for n, p in self.lab.learner.trainable_parameters().items()}, None

    def save_adapter(self, path: str):
        return self.lab.save_adapter(path), None

    def inspect(self):
        """What tests and notebooks compare: this rank's LoRA and AdamW shards, and the model's sharding layout."""
        return self.lab.inspect()[0], None

    def arm_fault(self, phase: str, error: str):
        """Make this rank's next `phase` fail inside it (recovery/faults.py)."""
        return self.lab.arm_fault(self.rank, phase, error), None


def config_changes(mine: dict, theirs: dict) -> dict:
    return {f"{s}.{f}": theirs[s][f] for s in theirs for f in theirs[s] if mine[s][f] != theirs[s][f]}


def boundary_state(lab) -> bytes:
    """This rank's state between steps (its shards only: no collective)."""
    from .models.fsdp import local, local_state
    from .runtime import capture_rng, runtime

    learner = lab.learner
    rng = capture_rng(runtime().cuda_indices(lab.config))  # this rank's own streams (its GPU's, not every GPU's)
    state = {
        "step": lab.step_index,
        "rng": rng,
        "lora": {n: local(p).detach().cpu().clone() for n, p in learner.trainable_parameters().items()},
        "optimizer": local_state(learner.optimizer.state_dict()),
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def restore_boundary(lab, data: bytes) -> None:
    """Put a rank's state at the start of a step back into a freshly loaded Lab (a restart)."""
    from .execution.sharded.gathered import load_optimizer_shards
    from .models.fsdp import local
    from .runtime import restore_rng

    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    learner = lab.learner
    with torch.no_grad():
        for name, p in learner.trainable_parameters().items():
            local(p).copy_(state["lora"][name])
    load_optimizer_shards(learner, state["optimizer"])
    restore_rng(state["rng"])
    lab.resume_at(state["step"])
