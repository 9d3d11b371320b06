"""A failed phase is undone with its random draws: the Lab keeps a copy of its random streams (torch's CPU and CUDA
generators, Python's; runtime.capture_rng) from before each phase of the step until the step ends, and puts back the one
its retry starts from, so the retry draws what a Lab that never failed draws (a rollout's rows' seeds,
generation/base.row_seeds; a backward's LoRA dropout masks). Which phase the retry starts from is the lifecycle's word
after the undo (lab.next_phase()): the failed phase itself, or the step's first backward when the undo rolled back the
step's updates (every update phase, and sync). The copies are a few KiB per phase, on the host."""

from __future__ import annotations


def phase_streams(lab, name: str) -> dict:
    """The random streams phase `name` starts from, this Lab's (runtime.own_streams); a rollout pending between its
    turns started from those before its first call (turns_api.PendingTurns). The step keeps the first of each phase:
    where a retry that redoes the step's updates starts (its first backward's)."""
    from ..runtime import capture_rng, own_streams, runtime

    own_streams(lab)
    step = lab.current
    if name == "rollout" and step.turns is not None:
        streams = step.turns.streams
    else:  # (the CUDA generators this process owns: a rank's own GPU's, as its checkpoint's)
        streams = capture_rng(runtime().cuda_indices(lab.config))
    step.streams.setdefault(name, streams)
    return streams


def put_streams_back(lab, name: str, streams: dict) -> None:
    """After phase `name` failed and the step was undone: the streams the phase its retry starts from first started
    from (a second backward's retry: the first's), else `streams`, the failed phase's own, when the retry starts there
    (a rollout that restarted its step); none: a step its executor lost starts over from the streams as they are."""
    from ..runtime import restore_rng

    resume = lab.next_phase()
    streams = lab.current.streams.get(resume, streams if resume == name else None)
    if streams is not None:
        restore_rng(streams)


def rewind_streams(lab, name: str) -> None:
    """Back to the random streams phase `name` of the current step first started from, where a hand-made undo
    (lab.rollback(): the step goes on from backward) redoes it; nothing when the step never ran it."""
    from ..runtime import own_streams, restore_rng

    own_streams(lab)
    streams = lab.current.streams.get(name)
    if streams is not None:
        restore_rng(streams)
