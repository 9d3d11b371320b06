"""The hf backend's token draw and its log-prob recorder, two logits processors that write every decoding step's
[sequences, vocab] results into buffers they hold, so a step allocates none of that width (a CPU learner's RSS rise
over a rollout's start is these buffers, the LM head's logits and the heap's holes between them: docs/benchmarks.md,
"A tool-calling rollout beside TRL's tool loop")."""

from __future__ import annotations

from typing import Optional

import torch


class InverseCdfSampler:
    """A logits processor that draws each sequence's next token from softmax(scores) by inverting its CDF with one
    uniform draw (float64 cumulative sums: exact to double precision; a token of probability 0, i.e. filtered by
    top-k/top-p, is never drawn), then returns scores whose only finite entry is that token, so generate()'s
    greedy choice takes it. One uniform per sequence instead of torch.multinomial's vocabulary-sized exponential
    draw (faster on the CPU). Same distribution, another random stream: tokens for a given seed differ from
    multinomial's. Its two [sequences, vocab] buffers live for the whole rollout, and every step's softmax and CDF are
    written into them. Why: allocated afresh every decoding step they fragment a CPU learner's heap (figures:
    docs/benchmarks.md, "The CPU rollout's heap").
    `seeds`: one CPU generator per row, so row i's t-th token uses the t-th uniform of its own stream whatever the
    rows beside it (a rank's share samples what one process samples); None: one draw over the batch from torch's RNG."""

    def __init__(self, seeds: Optional[list[int]] = None):
        self.cdf: Optional[torch.Tensor] = None  # float64 [n, V]
        self.out: Optional[torch.Tensor] = None  # the step's softmax, then the returned scores
        self.rows = None if seeds is None else [torch.Generator().manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids, scores):
        if self.out is None or self.out.shape != scores.shape or self.out.device != scores.device:
            self.cdf = torch.empty(scores.shape, dtype=torch.float64, device=scores.device)
            self.out = torch.empty_like(scores)
        # why into the held buffers: torch.softmax allocated an [n, V] result and cumsum(dtype=float64) a float64 copy
        # of it, 4.6 + 9.3 MiB a step at 8 x Qwen2.5's vocabulary; the same kernels, so the same bits
        torch.ops.aten._softmax.out(scores, -1, False, out=self.out)
        self.cdf.copy_(self.out).cumsum_(-1)
        total = self.cdf[:, -1:]
        if not torch.isfinite(total).all() or (total <= 0).any():
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        if self.rows is None:
            u = torch.rand(total.shape, dtype=torch.float64, device=scores.device)
        else:  # why on the CPU: a CPU generator's stream is the same on every device; n draws, one copy per step
            u = torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in self.rows]).to(scores.device)[
                :, None
            ]
        u = u * total
        token = torch.searchsorted(self.cdf, u, right=True).clamp_(max=scores.shape[-1] - 1)  # first cdf > u: p > 0
        return self.out.fill_(float("-inf")).scatter_(-1, token, 0.0)


class SampledLogprobs:
    """A logits processor that records log_softmax(scores) of each sampled token; placed last, after
    `sampling_processors`, the scores are those sampled from (filtered tokens at -inf).

    It keeps one step's [n, V] log-softmax only, in one buffer: the token sampled from step t is known at step t+1's
    call, which reads it before writing step t+1's. (`output_scores=True` would keep every step's [n, V] scores:
    O(n x length x vocab).) The recorded log-probs go into one [n, steps] buffer, made at the first call (doubled if a
    call runs past `steps`). Why not a [n] tensor per step: each lived to the rollout's end, and glibc carved such small
    blocks out of the freed [n, V] blocks' holes, so no [n, V] block fitted a hole again and the heap grew by one a step
    (docs/benchmarks.md, "The rollout's heap holes at glibc's own threshold")."""

    def __init__(self, steps: int = 64):
        self.previous: Optional[torch.Tensor] = None  # [n, V] float32: the last step's log-softmax
        self.recorded: Optional[torch.Tensor] = None  # [n, >= steps] float32: column t is step t's token's log-prob
        self.steps, self.count = steps, 0

    def _record(self, tokens: torch.Tensor) -> None:
        """Write the last step's log-prob of `tokens` ([n, 1]) into the next column (the temporary [n, 1] is freed)."""
        if self.recorded is None or self.count == self.recorded.shape[1]:
            grown = self.previous.new_empty(self.previous.shape[0], max(self.steps, 2 * self.count))
            if self.recorded is not None:
                grown[:, : self.count] = self.recorded
            self.recorded = grown
        self.recorded[:, self.count : self.count + 1] = self.previous.gather(-1, tokens)
        self.count += 1

    def __call__(self, input_ids, scores):
        if self.previous is not None:
            self._record(input_ids[:, -1:])
        scores32 = scores.float()
        if self.previous is None or self.previous.shape != scores32.shape or self.previous.device != scores.device:
            self.previous = torch.empty_like(scores32)
        # why in place: the last step's row is gathered above, so one buffer serves every step (no [n, V] allocated)
        torch.ops.aten._log_softmax.out(scores32, -1, False, out=self.previous)
        return scores

    def finish(self, new_tokens) -> torch.Tensor:
        """[n, T] log-probs of `new_tokens` (the last token's comes from the last stored step)."""
        if self.previous is not None and self.count < new_tokens.shape[1]:
            self._record(new_tokens[:, -1:].to(self.previous.device))
        self.previous = None  # why: drop the last [n, V] log-softmax as soon as it is used
        if not self.count:
            return torch.zeros(new_tokens.shape, dtype=torch.float32)
        recorded, self.recorded, self.count = self.recorded[:, : self.count].clone(), None, 0
        return recorded
