"""What each generate() call of a tool loop's turn fed the model, as the planner's `Turn` takes it
(planner/turns.py): the rows in flight, the tokens prefilled at once (left-padded, as the forward sees them), the
KV context after that prefill and the tokens decoded after it (one forward each). The hf backend wraps its calls
(generation/hf.py); the loop takes a turn's calls as they end and labels them with the turn's mark
(tools/loop.py Episode.decode: Rollout.turn_shapes). A backend that does not wrap its calls records nothing."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable


class TurnShapes:
    """A generator's recorder: while `recording`, each wrapped generate() call appends its shape."""

    def __init__(self):
        self.on, self.made = False, []
        self.mark = None  # the turn being recorded ("turn 2"), None outside a tool loop's turn

    def wrap(self, call: Callable) -> Callable:
        """`call(ids, mask, cache, max_new_tokens, stop)` (HFGenerator.generate_once, bound), recording its shape."""

        def recorded(ids, mask, cache, max_new_tokens, stop):
            cached = cache.get_seq_length() if cache is not None else 0  # (the columns the call goes on from)
            sequences, cache, logprobs = call(ids, mask, cache, max_new_tokens, stop)
            if self.on:  # why decoded - 1: the prefill's forward samples the first new token
                self.made.append(dict(rows=ids.shape[0], prefill=ids.shape[1] - cached, context=ids.shape[1],
                                      decode=sequences.shape[1] - ids.shape[1] - 1))  # fmt: skip
            return sequences, cache, logprobs

        return recorded

    @contextmanager
    def recording(self, mark: str, into: list):
        """Within: the calls' shapes, each labelled `mark`, appended to `into` (a call cut short records nothing)."""
        self.on, self.made, self.mark = True, [], mark
        try:
            yield
        finally:
            into += [{"mark": mark, **s} for s in self.made]
            self.on, self.made, self.mark = False, [], None
