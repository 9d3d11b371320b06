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
from dataclasses import replace

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
    in `calls` near-equal chunks, each within chunk_size, and a rank with no rows samples a stand-in row, discarded.
    With a tool loop (generator.turns), each rank runs it on its own rows (tools_in_step); their environments and
    tool calls are the driver's (execution/sharded/driven.py)."""
    me, g = runtime(), num_generations
    episode = generator.turns.start(batch, g, request) if generator.turns is not None else None
    if episode is not None:  # each row's prompt rendered with its tools, every rank alike
        batch, prompt_ids = episode.batch, generator.encode_prompts(episode.prompts, request.max_prompt_length)
    else:
        prompt_ids = generator.prompt_rows(batch, g, request)  # [N], every rank alike
    shares = [me.share(len(batch), k) for k in range(me.size)]
    rows = [range(s.start * g, s.stop * g) for s in shares]  # each rank's rows
    per_call = request.chunk_size or max(map(len, rows))
    calls = max(math.ceil(len(r) / per_call) for r in rows)
    samples, made = [], 0
    for part in split(rows[me.rank], calls):
        if episode is not None:
            samples.extend(tools_in_step(generator, episode, part, prompt_ids, request, seeds, width))
            made += bool(part)
            continue
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
    if episode is not None:
        episode.finish(out)
    agree_on(out)
    return out


def tools_in_step(generator, episode, part, prompt_ids, request, seeds, width) -> list:
    """This rank's rows `part` through the tool loop (tools/loop.py Episode.run), its engine calls kept in step with
    every other rank's: before each call a rank says whether it makes one (a gather); a rank whose rows need no more
    turns (or that has none) samples a one-token stand-in row for as long as another rank still calls, so every
    rank makes as many calls as the one with the most turns. generator.turn_cache keep goes on from each row's KV
    here too (not through the shards: a synced decode prefills each turn)."""
    from .turn_cache import TurnCache

    me = runtime()
    synced = me.sharded and not request.gather_for_generation
    static = generator._settings(request).cache_implementation is not None  # (hf_decode static or compiled)
    keep = request.turn_cache == "keep" and not (synced or static)  # (a growing cache only, as one process)
    kept = TurnCache(generator.tokenizer.pad_token_id, request) if keep else None

    def sample(contexts, rows, turn):
        me.gather_objects(True)  # (this rank calls the engine: the others call with it)
        held = kept.for_rows(rows) if kept is not None else None
        return generator.generate_chunk(contexts, turn, [seeds[i] for i in rows], width, None, held)

    samples = episode.run([prompt_ids[i] for i in part], part, sample, request) if part else []
    stand_in = replace(request, max_completion_length=1, full_length=False)
    while any(me.gather_objects(False)):  # why: another rank's turn needs this rank's engine call beside it
        generator.generate_chunk([prompt_ids[0]], stand_in, [0], width)
    return samples


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
