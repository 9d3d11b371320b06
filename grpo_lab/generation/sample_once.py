"""Sample once: the hf rollout of a sharded learner is computed once for all ranks, not N times. Each rank samples
its share of the prompt groups (whole groups, runtime.share), the ranks all-gather the samples, and every rank builds
the same whole rollout, rows in one process's order. A sha256 of the rollout is then agreed across the ranks.

Rows equal one process's because every row samples from its own seed (base.row_seeds, drawn alike on every rank) and
is padded to the whole batch's prompt width (hf.py); what a rank's forward still changes is the batch size, which
may round float32 log-probs differently (<= 1.2e-6 measured on the CPU; bfloat16 was bit-equal; a flipped token is
possible in principle where a kernel's rounding depends on the batch size). tests/test_sharded_rollout.py states
the tolerance. The vLLM path samples once already (one engine in the driver: sharded/remote.py).
"""

from __future__ import annotations

import hashlib
import math
import os

from ..algo.containers import Rollout
from ..errors import LabError
from ..recovery.faults import diverge
from ..runtime import runtime
from .base import split

REPLICATED = "GRPO_LAB_REPLICATED_ROLLOUT"  # bench/probes/sharded_rollout.py only: every rank samples the whole batch


def replicated() -> bool:
    """The replicated rollout (every rank samples every row, as before sample-once), forced for the benchmark."""
    return os.environ.get(REPLICATED) == "1"


def sample_once(generator, batch, num_generations: int, request, seeds: list[int], width: int) -> Rollout:
    """This rank samples its share of the groups and gets every rank's; `generator.generate_chunk` samples, with
    `seeds[i]` for row i, left-padded to the whole batch's prompt `width`. Every rank makes the same number of engine
    calls (each one's `generation` context gathers collectively, and through the shards every forward does): its rows
    in `calls` near-equal chunks, each within chunk_size, and a rank with no rows samples a stand-in row, discarded."""
    me, g = runtime(), num_generations
    prompt_ids = generator.prompt_rows(batch, g, request)  # [N], every rank alike
    shares = [me.share(len(batch), k) for k in range(me.size)]
    rows = [range(s.start * g, s.stop * g) for s in shares]  # each rank's rows
    per_call = request.chunk_size or max(map(len, rows))
    calls = max(math.ceil(len(r) / per_call) for r in rows)
    samples, made = [], 0
    for part in split(rows[me.rank], calls):
        if not part:  # why: the others' engine calls need this rank's (a collective gather or a synced forward)
            generator.generate_chunk([prompt_ids[0]], request, [0], width)
            continue
        samples.extend(
            generator.generate_chunk([prompt_ids[i] for i in part], request, seeds[part.start : part.stop], width)
        )
        made += 1
    everyone = me.gather_objects((samples, made))  # why objects: each rank's rows are ragged lists until padded
    out = generator.to_rollout(batch, g, prompt_ids, [s for part, _ in everyone for s in part], request)
    out.generate_calls = sum(n for _, n in everyone)
    agree_on(out)
    return out


def digest(rollout: Rollout) -> str:
    """sha256 of the rollout's token ids and masks (prompt and completion)."""
    h = hashlib.sha256()
    for t in (rollout.prompt_ids, rollout.prompt_mask, diverge(rollout.completion_ids), rollout.completion_mask):
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def agree_on(rollout: Rollout) -> None:
    """Every rank's checksum, gathered: the same list on every rank, so every rank takes the same branch (and with a
    mismatch raises the same line; the Lab's phase end then settles the failure on every rank, runtime.settle)."""
    sums = runtime().gather_objects(digest(rollout))
    if len(set(sums)) > 1:
        major = max(set(sums), key=sums.count)  # the ranks that differ: from the majority, if any, else from rank 0
        usual = major if sums.count(major) > len(sums) / 2 else sums[0]
        odd = [k for k, s in enumerate(sums) if s != usual]
        each = ", ".join(f"rank {k} {s[:12]}" for k, s in enumerate(sums))
        raise LabError(
            f"rollout: rank {', '.join(map(str, odd))} hold{'s' if len(odd) == 1 else ''} a rollout unlike "
            f"the others' after the gather (sha256 of the token ids and masks: {each}); the ranks' prompts or sampling "
            "diverged, and nothing was trained on it"
        )
