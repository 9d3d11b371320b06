"""generator.turn_cache keep: a tool loop's turn continues from the KV cache of the turns before it (hf backend,
growing cache). The loop (tools/loop.py) asks each turn for the rows' whole contexts, as for a re-prefill; this
holds the last turn's sequences, attention mask and DynamicCache, and a call whose rows it holds goes on from them:
the rows that stay are selected (`DynamicCache.batch_select_indices`: the finished rows leave between turns), each
row's cached tokens that its context no longer starts with (the pads after its stop token, tokens past its budget)
are masked out, and only the rest of its context (the tool result's tokens, and the last sampled token, never
forwarded) is prefilled, left-padded within the new columns. Positions come from the mask (transformers' cumsum), so
a row's tokens sit where a re-prefill puts them: the same tokens as a full re-prefill (tests/test_turn_cache.py).
The cache's columns are the rows' union (a row that stopped early keeps its masked columns), so a turn whose cache
would pass the planned KV length (generator.max_prompt_length + max_completion_length: the plan's KV line) prefills
afresh instead."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch


class TurnCache:
    """One rollout's kept KV: the rows of its last generate() call, in the cache's order."""

    def __init__(self, pad_token_id: int, request):
        """`request`: the rollout's; its prompt length + trajectory budget is the planned KV length, in tokens."""
        self.pad, self.length = pad_token_id, request.max_prompt_length + request.max_completion_length
        self.rows: list[int] = []  # batch row numbers held
        self.asked: list[int] = []  # the rows of the call being made
        self.sequences: Optional[torch.Tensor] = None  # [n, W] every column the cache was filled from (CPU)
        self.mask: Optional[torch.Tensor] = None  # [n, W] 1 where the cached column is the row's context
        self.cache = None  # the DynamicCache (W - 1 columns: the last token is not forwarded yet)

    def for_rows(self, rows: Sequence[int]) -> "TurnCache":
        self.asked = list(rows)
        return self

    def clear(self) -> None:
        """Let the held KV go (why before a fresh prefill: a chunk's cache never lives beside the next one's)."""
        self.rows, self.sequences, self.mask, self.cache = [], None, None, None

    def start(self, contexts: list[list[int]], input_ids: torch.Tensor, attention: torch.Tensor, call, request):
        """The generate() call's (input ids, attention mask, cache, `call` recording its outcome): continued from the
        held cache when it holds every asked row and the continued cache, the turn's `request` decoded on, stays
        within the planned length; else the fresh, left-padded `input_ids` and `attention` with no cache."""
        ids, mask, cache = self.inputs(contexts, input_ids, attention, request.max_completion_length)
        return ids, mask, cache, self.recording(call)

    def inputs(self, contexts: list[list[int]], input_ids: torch.Tensor, attention: torch.Tensor, new_tokens: int):
        """`start`'s inputs (ids, mask, cache)."""
        held = {r: i for i, r in enumerate(self.rows)}
        if self.cache is None or not self.asked or any(r not in held for r in self.asked):
            self.clear()
            return input_ids, attention, None
        index = [held[r] for r in self.asked]
        self.cache.batch_select_indices(torch.tensor(index))
        cached = self.cache.get_seq_length()
        sequences, mask = self.sequences[index, :cached], self.mask[index, :cached].clone()
        news = []
        for k, context in enumerate(contexts):
            columns = mask[k].nonzero().squeeze(-1)
            have = sequences[k, columns].tolist()
            same = common_prefix(have, context)
            same = min(same, len(context) - 1)  # (at least one token is fed: the next token's logits come from it)
            mask[k, columns[same:]] = 0  # why: cached past where the contexts part (pads after a stop, a cut turn)
            news.append(context[same:])
        width = max(map(len, news))
        if cached + width + new_tokens > max(self.length, input_ids.shape[1] + new_tokens):  # (never above a prefill)
            self.clear()  # why: the rows' union of columns would pass the planned KV; the conversation prefills
            return input_ids, attention, None
        new_ids = torch.tensor([[self.pad] * (width - len(n)) + n for n in news], dtype=sequences.dtype)
        new_mask = torch.tensor([[0] * (width - len(n)) + [1] * len(n) for n in news], dtype=mask.dtype)
        return torch.cat([sequences, new_ids], 1), torch.cat([mask, new_mask], 1), self.cache

    def recording(self, call: Callable) -> Callable:
        """`call` (HFGenerator.generate_once with its settings bound), keeping what it returns for the next turn."""

        def recorded(ids, mask, cache, max_new_tokens, stop):
            sequences, cache, logprobs = call(ids, mask, cache, max_new_tokens, stop)
            grown = sequences.shape[1] - ids.shape[1]
            self.rows, self.sequences, self.cache = self.asked, sequences.cpu(), cache
            self.mask = torch.cat([mask.cpu(), torch.ones(mask.shape[0], grown, dtype=mask.dtype)], 1)
            return sequences, cache, logprobs

        return recorded


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
