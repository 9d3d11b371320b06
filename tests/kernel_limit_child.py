"""A child process for tests/test_kernel_limit.py and bench/probes/kernel_limit_overshoot.py: a Lab under a
kernel-enforced host limit (placement.host_limit: cgroup) runs a step that crosses it, with the live guard or without.

    python tests/kernel_limit_child.py hog|03|04 live|unchecked|off [MIB]

hog: the tiny model, its budget MIB (default 600) above this process's RSS after its imports, a reward function that
allocates 8 MiB at a time up to 1.5 GiB; 03: notebook 03's failing config (64 sequences in one generate call) under a
budget of MIB (default 870), then its fix (chunks of 16); 04: notebook 04's failing config (the full head on Qwen2.5's
vocabulary) under its 2.0 GiB, then its fix (the chunked head). live: the live guard; unchecked: the live guard
without the room check before one big native allocation (algo/room.py); off: neither. Prints one JSON line per
event ({"event": ...}); killed by the kernel, it prints nothing more (rc -9).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Optional

import numpy as np
import psutil
import torch

MiB = 1024**2
STEP = 8 * MiB
NOTEBOOK_04 = [
    "model.dtype=float32",
    "model.bnb_4bit_compute_dtype=float32",
    "generator.max_completion_length=128",
    "grpo.logprob_head=full",
]
NOTEBOOK_03 = [
    "grpo.num_generations=16",
    "grpo.prompts_per_step=4",
    "generator.max_prompt_length=64",
    "generator.max_completion_length=128",
    "model.name_or_path=builtin:kv-heavy",
    "generator.chunk_size=null",
]


class Hog:
    """A reward function that, when on, allocates host memory up to `total` in `STEP`s (touched, so it is charged)."""

    def __init__(self, total: int = 1536 * MiB):
        self.on, self.total, self.reached = False, total, 0

    def __call__(self, prompts, completions, **kwargs):
        if self.on:
            held, self.reached = [], 0
            say("hog", reached_mib=0)
            while self.reached < self.total:
                held.append(np.ones(STEP // 8))
                self.reached += STEP
                time.sleep(0.002)
        return [0.0 for _ in completions]


def say(event: str, **facts) -> None:
    print(json.dumps({"event": event, **facts}), flush=True)


def state_of(lab) -> list:
    named = lab.learner.trainable_parameters()
    state = lab.learner.optimizer.state
    return [t.detach().clone() for t in named.values()] + [
        v.clone() for p in named.values() for v in state.get(p, {}).values()
    ]


def lab_for(kind: str, mib: Optional[float]):
    from grpo_lab import Lab, load_config

    if kind == "04":
        budget = f"placement.host_memory_gib={(mib or 2048) / 1024:.4f}"
        return Lab(load_config("logits-heavy-cpu", [*NOTEBOOK_04, budget, "placement.host_limit=cgroup"])).load(), None
    if kind == "03":
        budget = f"placement.host_memory_gib={(mib or 870) / 1024:.4f}"
        config = load_config("tiny-cpu", [*NOTEBOOK_03, budget, "placement.host_limit=cgroup"])
        return Lab(config).load(), None
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from conftest import tiny_dict

    from grpo_lab.models.source import resolve_model_path

    hog = Hog()
    gib = (psutil.Process().memory_info().rss + (mib or 600) * MiB) / 1024**3
    placement = {"host_limit": "cgroup", "host_memory_gib": round(gib, 3)}
    config = tiny_dict(resolve_model_path("builtin:tiny-random"), placement=placement)
    return Lab(config, reward_funcs=["format", hog]).load(), hog


def peak_used(lab, since: int) -> dict:
    """The row of the highest host `used` peak from row `since`."""
    return max((r for r in lab.memory.phase_rows[since:] if r["metric"] == "used"), key=lambda r: r["peak"], default={})


def main(kind: str, live: str, mib: Optional[float] = None) -> None:
    from grpo_lab import LabError

    lab, hog = lab_for(kind, mib)
    kernel = lab.memory.kernel
    say("loaded", group=str(kernel.path), limit_mib=kernel.budget / MiB, held_mib=kernel.held / MiB)
    if live != "live":
        import grpo_lab.algo.head as head

        head.before_allocating = lambda nbytes, what: None  # no room check before the full head's buffers
    if live == "off":
        lab.memory.live = None  # the after-phase veto alone: it judges a phase that the kernel lets end
    if hog is not None:
        lab.step()
        hog.on = True
    before, first = state_of(lab), len(lab.memory.phase_rows)
    try:
        lab.step()
        say("ran", peak_mib=peak_used(lab, first).get("peak", 0) / MiB)
    except LabError as err:
        after = state_of(lab)
        row = peak_used(lab, first)
        line = kernel.budget * lab.memory.host_threshold
        say(
            "stopped",
            message=str(err),
            phase=row.get("phase"),
            peak_mib=row.get("peak", 0) / MiB,
            line_mib=line / MiB,
            same=all(torch.equal(a, b) for a, b in zip(before, after)) and len(before) == len(after),
        )
    if hog is not None:
        hog.on = False
    elif kind == "04":
        lab.configure(grpo={"logprob_head": "chunked"})
    else:
        lab.configure(generator={"chunk_size": 16})
    fixed = lab.step()
    peak = max(r["peak"] for r in lab.memory.rows_for(fixed.step) if r["metric"] == "used")
    say("fixed", step=fixed.step, peak_mib=peak / MiB, limit_mib=kernel.budget / MiB)
    lab.close()


if __name__ == "__main__":
    main(*sys.argv[1:3], *map(float, sys.argv[3:4]))
