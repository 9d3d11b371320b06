"""A crossing inside a mark of its phase (memory/sampler.py `mark`: a tool loop's `turn N` and `tools N` inside the
rollout): the guard's and the out-of-memory's one line name the mark it crossed in, and the knobs that lower that
mark's memory, looked up by the mark's kind (its label's first word) in MARK_FIXES."""

from __future__ import annotations

from typing import Optional

# a mark's kind -> what lowers its memory (the fix its one line offers first)
MARK_FIXES: dict[str, str] = {
    # why these knobs: a turn holds the KV cache of every row in flight over its whole context so far (prompt, the
    # turns before, the tools' results), so the rows, the turns, each result and the trajectory's budget each bound it
    "turn": "a multi-turn rollout grows turn by turn with the rows in flight and their contexts: lower "
    "generator.chunk_size (the rows in flight), generator.max_tool_calling_iterations (the turns), "
    "generator.max_tool_response_tokens (the tool-result bound) or generator.max_completion_length (the trajectory "
    "budget)",
    # why: the tools run while the rows' turns are held, and their results are held whole until the bound cuts them
    "tools": "the tools ran with the rows' turns held: bound their results (generator.max_tool_response_tokens), or "
    "lower generator.chunk_size (the rows in flight) or generator.max_tool_calling_iterations (the turns)",
}


def at_mark(label: Optional[str]) -> str:
    """Where in its phase a crossing happened, for its one line (empty outside a mark)."""
    return f", at {label}" if label else ""


def mark_fix(label: Optional[str]) -> Optional[str]:
    """The fix MARK_FIXES gives the mark's kind (None: outside a mark, or a kind it has none for)."""
    return MARK_FIXES.get(label.split()[0]) if label else None


def _of_phase(segments: list[dict], step: int, phase: str) -> list[dict]:
    return [m for m in segments if m["step"] == step and m["phase"] == phase and m["failed_attempt"] is None]


def peak_mark(segments: list[dict], step: int, phase: str, key=("host", "used")) -> Optional[str]:
    """The mark of `step`'s `phase` (its attempt under way or just ended) whose `key` peak is the highest: where a
    phase that ran to its end crossed."""
    marks = [m for m in _of_phase(segments, step, phase) if key in m["peak"]]
    return max(marks, key=lambda m: m["peak"][key])["mark"] if marks else None


def last_mark(segments: list[dict], step: int, phase: str) -> Optional[str]:
    """The last mark of `step`'s `phase` (of its latest attempt, filed as failed or not): where a failed phase
    stopped."""
    marks = [m for m in segments if m["step"] == step and m["phase"] == phase]
    return marks[-1]["mark"] if marks else None
