"""generator.drop_finished_rows: finished rows leave the batch at bucket boundaries (half the rows, then a quarter...),
so a group whose completions mostly ended stops paying for full width.

The rollout is one generate() call per bucket: a stopping criterion ends the call once at most half of its rows are
unfinished; the unfinished rows' KV cache is kept (`DynamicCache.batch_select_indices`) and the next call continues
from it. Each row keeps its own sampling stream (InverseCdfSampler's per-row generators), so a row samples the same
tokens whether the rows beside it left or not, and greedy tokens equal one call's (tests/test_leaving.py)."""

from __future__ import annotations

from typing import Callable, Optional

import torch


class LeaveAtBucket:
    """A stopping criterion: the call ends once at most `threshold` of its rows have no stop token among the tokens it
    generated (generate() ends a call when every row says done)."""

    def __init__(self, start: int, eos_ids: list[int], threshold: int):
        self.start, self.eos, self.threshold = start, torch.tensor(eos_ids), threshold

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        if self.eos.device != input_ids.device:  # why once: this runs at every decoding step
            self.eos = self.eos.to(input_ids.device)
        finished = torch.isin(input_ids[:, self.start :], self.eos).any(-1)
        leave = int((~finished).sum()) <= self.threshold
        return torch.full_like(finished, leave)


def decode_leaving(
    call: Callable,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    max_new_tokens: int,
    eos_ids: list[int],
    keep_rows: Callable[[list[int]], None],
    leave: bool,
    cache=None,
) -> tuple[list[list[int]], list[list[float]]]:
    """Every row's new tokens and their sampler log-probs. `call(ids, attention, cache, max_new_tokens, stop)` runs one
    generate() and returns (sequences, cache, log-probs of the new tokens); `keep_rows(indices)` narrows the samplers'
    per-row state to the rows that stay. `leave` False: one call, every row to the end. `cache`: the first call's
    (a tool loop's turn going on from the turns before it: generation/turn_cache.py)."""
    n = input_ids.shape[0]
    rows, tokens, logprobs = list(range(n)), [[] for _ in range(n)], [[] for _ in range(n)]
    ids, mask, left = input_ids, attention, max_new_tokens
    eos = torch.tensor(eos_ids)
    while True:
        stop = LeaveAtBucket(ids.shape[1], eos_ids, len(rows) // 2 if leave else -1)
        sequences, cache, lp = call(ids, mask, cache, left, stop)
        new = sequences[:, ids.shape[1] :]
        for i, row in enumerate(rows):
            tokens[row] += new[i].tolist()
            logprobs[row] += lp[i].tolist()
        left -= new.shape[1]
        done = torch.isin(new.cpu(), eos).any(-1)  # (a row still here had no stop token before this call)
        keep = (~done).nonzero().squeeze(-1)
        if left <= 0 or len(keep) == 0 or not leave:
            return tokens, logprobs
        # why select, not restart: the unfinished rows' keys and values stay; only the finished rows' are dropped
        cache.batch_select_indices(keep.to(sequences.device))
        rows = [rows[i] for i in keep.tolist()]
        ids = sequences[keep.to(sequences.device)]
        grown = torch.ones(mask.shape[0], new.shape[1], dtype=mask.dtype, device=mask.device)
        mask = torch.cat([mask, grown], dim=1)[keep.to(mask.device)]
        keep_rows(keep.tolist())


def keep_sampler_rows(samplers: list, indices: list[int]) -> None:
    """Narrow each per-row sampler to `indices` (InverseCdfSampler: its rows' generators, whose streams go on)."""
    for sampler in samplers:
        rows: Optional[list] = getattr(sampler, "rows", None)
        if rows is not None:
            sampler.rows = [rows[i] for i in indices]
