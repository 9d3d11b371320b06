"""The rollout phase as `Lab.rollout(turns=None)` runs it: whole, or a tool-calling rollout turn by turn from notebook
cells. `lab.rollout(turns=1)` runs one more turn of every row still going (its decode, then the tools it called) and
returns what each row called and each tool answered so far (tools/stepwise.TurnsView), leaving the rollout pending;
`lab.rollout()` runs the rest and ends the phase. Why a call per cell rather than an iterator: each cell is one phase
call, checked, timed and undone as any phase is, and nothing is suspended between cells (no thread; no generator frame
holding the phase open, lost when its cell runs again).

Between calls the step's state holds the paused episode (every row's trajectory, tools and environment: the ToolLoop's
`paused`), the random streams and the prompt source's position from before the rollout; each call puts those back and
runs the rollout phase from the episode, so its rows draw the seeds and prompts one uninterrupted rollout draws, and
sample its tokens (tests/test_turn_api.py). Live edits between calls apply to the turns still to run (the turn cap
generator.max_tool_calling_iterations, generator.chunk_size: the rows in flight); those the turns already run cannot
honour are refused in one line (tools/stepwise.check_paused). A failure in any call undoes the whole rollout phase, as a
failed rollout is undone; lab.rollback() drops the pending turns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .errors import LabError

# the backends whose rollout can pause between turns: the hf one runs in this process, its episode kept here
PAUSES = {"hf"}


@dataclass
class PendingTurns:
    """A rollout pending between its calls (StepState.turns)."""

    streams: dict  # the random streams before the rollout (runtime.capture_rng)
    position: dict  # the prompt source's position before the rollout
    episode: Any = None  # the paused tools.loop.Episode
    turns: int = 0  # the turns run so far


def rollout_phase(lab, turns: Optional[int] = None):
    """The step's rollout (a Rollout): whole, or, with `turns` or turns pending, by turns (see the module)."""
    if turns is None and lab.current.turns is None:
        return whole(lab)
    if turns is not None:
        check_turns(lab, turns)
    return by_turns(lab, turns)


def check_turns(lab, turns) -> None:
    """Refuse, in one line, a turn-by-turn call this Lab cannot run."""
    call = f"lab.rollout(turns={turns!r})"
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise LabError(f"{call}: turns is how many more turns to run, at least 1; pass turns=1, or call lab.rollout()")
    check_pauses(lab.config, call)
    lab._require_loaded()
    if getattr(lab.generator, "turns", None) is None:
        raise LabError(
            f"{call}: this Lab has no tools, so its rollout is one turn; call lab.rollout(), or make a Lab with "
            "tools=[...] (or environment_factory=...)"
        )


def check_pauses(config, call: str) -> None:
    """Refuse, in one line, a turn-by-turn `call` where the rollout cannot pause between turns."""
    procs, backend = config.placement.learner_procs, config.generator.backend
    if procs > 1:
        raise LabError(
            f"{call}: a sharded learner (placement.learner_procs = {procs}) cannot pause its ranks' rollout between "
            "turns; call lab.rollout() for the whole rollout"
        )
    if backend not in PAUSES:
        raise LabError(
            f"{call}: generator.backend {backend!r} cannot pause a rollout between turns (only "
            f"{', '.join(sorted(PAUSES))} can); call lab.rollout() for the whole rollout"
        )


def fresh_step(lab) -> None:
    """A rollout on a started step restarts it (when no update was applied yet): the earlier rollout's phases become a
    failed attempt, and the step's own prompts are sampled again (two settings tried on one step compare on them)."""
    if lab.current.started:
        lab._restart_step()
        if lab.prompts is not None:  # (a sharded learner's: its driver's, which hands every rank the rows)
            lab.prompts.rewind()


def whole(lab):
    with lab._phase("rollout"):
        fresh_step(lab)
        out = lab._compute("rollout")
        out.step = lab.step_index
    lab.current.rollout = out  # why after the phase: a rollout the host guard fails as it ends is not kept
    return out


def by_turns(lab, turns: Optional[int]):
    """`turns` more turns of the pending rollout (a new one when none is pending): its TurnsView; None: the rest of
    it, ending the phase: the Rollout."""
    from .runtime import capture_rng, own_streams, restore_rng

    loop, pending = lab.generator.turns, lab.current.turns
    with lab._phase("rollout"):
        own_streams(lab)
        if pending is None:
            fresh_step(lab)
            pending = PendingTurns(capture_rng(), lab.prompts.state_dict())
        else:  # why: the call draws the rollout's seeds and prompts again, as its first call drew them
            restore_rng(pending.streams)
            lab.prompts.load_state_dict(pending.position)
        # why no KV cache is kept between calls: a pending rollout holds no device memory while the cells between
        # its turns run (the next turn prefills its rows' conversations again, the same tokens: turn_cache.py)
        with loop.continuing(None if turns is None else pending.turns + turns):
            out = lab._compute("rollout")
        pending.episode = loop.paused
    if turns is None:  # (after the phase, as a whole rollout: one the host guard fails as it ends is not kept)
        lab.current.turns, loop.paused = None, None
        out.step = lab.step_index
        lab.current.rollout = out
        return out
    pending.turns = max(t.turns for t in pending.episode.rows.values())
    lab.current.turns = pending
    return loop.view(lab.step_index)


def drop_turns(lab) -> None:
    """lab.rollback(), and a failed phase: the pending turns go, the prompts go back to before the rollout (its retry
    samples the step's own), and its calls' timings and memory rows become a failed attempt."""
    loop = getattr(lab.generator, "turns", None)
    if loop is not None:
        loop.paused = None
    pending, step = lab.current.turns, lab.step_index
    if pending is None:
        return
    lab.current.turns = None
    lab.prompts.load_state_dict(pending.position)
    if any(r.step == step and r.phase == "rollout" and r.failed_attempt is None for r in lab.timeline.records):
        lab._retire({"rollout"})  # (a failed call's phase retired them already)
