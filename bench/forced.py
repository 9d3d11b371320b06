"""A logits processor that makes a generate() call write given tokens first (then freely): how the benches and the
tool tests get tool calls out of the tiny random models, which never write one themselves."""

from __future__ import annotations

import torch


class ForcedTokens:
    """Every row of the call writes `ids` first (each as the only token it may sample), then samples freely. One per
    generate() call: it counts positions from the first input it sees."""

    def __init__(self, ids: list[int]):
        self.ids, self.start = ids, None

    def __call__(self, input_ids, scores):
        self.start = input_ids.shape[1] if self.start is None else self.start
        pos = input_ids.shape[1] - self.start
        if pos < len(self.ids):
            scores = torch.full_like(scores, -torch.inf)
            scores[:, self.ids[pos]] = 0.0
        return scores
