"""Reward functions that misbehave on purpose, importable as 'memory_hog:<name>' (tests/ on the path)."""

_held = []


def leak_20mib(prompts, completions, **kwargs):
    """Keeps 20 MiB alive per call: a leak the detector must flag."""
    _held.append(bytearray(20 * 1024**2))
    return [float(len(c) % 5) for c in completions]


HOG_TOTAL = 1024 * 1024**2  # what `once_on_rank_1` means to allocate: far past a rank's line
HOG_STEP = 8 * 1024**2
_hogged = []  # (reached bytes, finished) of this process's hog calls


def once_on_rank_1(prompts, completions, **kwargs):
    """On rank 1 of a sharded learner, the first call allocates host memory step by step up to HOG_TOTAL (pages
    touched, so RSS grows), held in its frame only; every other call, and every other process, scores plainly."""
    import time

    import numpy as np

    from grpo_lab.runtime import runtime

    if runtime().rank == 1 and not _hogged:
        held, reached = [], 0
        _hogged.append([0, False])
        while reached < HOG_TOTAL:
            held.append(np.ones(HOG_STEP // 8))  # ones: the pages are touched
            reached += HOG_STEP
            _hogged[-1][0] = reached
            time.sleep(0.002)
        _hogged[-1][1] = True
    return [0.0 for _ in completions]
