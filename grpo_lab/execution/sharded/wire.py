"""What a sharded learner's ranks send their driver besides results: one-line errors, and the memory samples a rank took
since its last reply. Shared by both sides (sharded/ranks.py, grpo_lab/rank.py), so neither imports the other.
"""

from __future__ import annotations

import time
import traceback


def one_line(err: BaseException) -> str:
    from ...errors import LabError

    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if isinstance(err, LabError):
        return text
    return f"{type(err).__name__}: {text}" if text else "".join(traceback.format_exception_only(type(err), err)).strip()


def memory_since(sampler, sent: dict) -> dict:
    """The samples, per-phase rows and ended marks (a tool loop's turns) taken since the last reply (and advance
    `sent`). `wall0`: the wall-clock time of the sampler's start, so the driver places a rank's samples on its own
    time axis across machines (each machine's perf_counter is its own)."""
    if sampler is None:
        return {}
    samples = sampler.samples_since(sent["samples"])
    rows = [dict(r) for r in sampler.phase_rows[sent["rows"] :]]
    marks = sampler.segments_since(sent.get("marks", 0))  # (a tool loop's turns: each with its own peaks)
    sent["samples"], sent["rows"], sent["marks"] = (
        sampler.total,
        len(sampler.phase_rows),
        sent.get("marks", 0) + len(marks),
    )
    wall0 = time.time() - (time.perf_counter() - sampler.t0)
    own = sampler.readers[0].budget is not None  # a rank held to its own budget: its host `used` is its own RSS
    return {"wall0": wall0, "samples": samples, "rows": rows, "marks": marks, "own_host": own}
