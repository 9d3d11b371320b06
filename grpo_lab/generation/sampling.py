"""The hf backend's decoding step: one logits processor that picks each row's token (InverseCdfSampler's draw, or the
argmax when greedy), records its log-prob (SampledLogprobs) and writes generate()'s choice over the step's scores.
Every [vocab]-wide result is made a block of rows at a time (generation/step_memory.py block_rows: one row of
Qwen2.5's vocabulary on a CPU, every row on a GPU) in buffers held for the rollout, so a step allocates nothing of
[rows, vocab] width (a CPU learner's RSS rise over a rollout's start is transformers' logits, these buffers and the
heap's holes between them: docs/benchmarks.md, "A tool-calling rollout beside TRL's tool loop")."""

from __future__ import annotations

from typing import Optional

import torch

from .step_memory import block_rows


class RowBuffers:
    """A block of rows' float32 softmax / log-softmax and float64 CDF, [block_rows(vocab), vocab], held across steps."""

    def __init__(self):
        self.row: Optional[torch.Tensor] = None  # float32 [block, V]
        self.cdf: Optional[torch.Tensor] = None  # float64 [block, V]

    def ready(self, scores: torch.Tensor) -> "RowBuffers":
        rows = scores.shape[0]
        shape = (min(block_rows(scores.shape[-1], scores.device.type) or rows, rows), scores.shape[-1])
        if (
            self.row is None
            or self.row.shape[-1] != shape[-1]
            or self.row.shape[0] < shape[0]
            or self.row.device != scores.device
        ):
            self.row = torch.empty(shape, dtype=torch.float32, device=scores.device)
            self.cdf = torch.empty(shape, dtype=torch.float64, device=scores.device)
        return self

    def blocks(self, n: int):
        """(start, stop) of each block of `n` rows."""
        step = self.row.shape[0]
        return [(i, min(i + step, n)) for i in range(0, n, step)]


class InverseCdfSampler:
    """Draws each sequence's next token from softmax(scores) by inverting its CDF with one uniform draw (float64
    cumulative sums: exact to double precision; a token of probability 0, i.e. filtered by top-k/top-p, is never
    drawn). One uniform per sequence instead of torch.multinomial's vocabulary-sized exponential draw (faster on the
    CPU). Same distribution, another random stream: tokens for a given seed differ from multinomial's. A block of rows
    at a time (block_rows): its softmax and CDF go into RowBuffers (the same kernels per row, so the same bits as over
    the batch). Why: [rows, vocab] float32 + float64 buffers were 13.9 MiB of a step at 8 x Qwen2.5's vocabulary.
    `seeds`: one CPU generator per row, so row i's t-th token uses the t-th uniform of its own stream whatever the
    rows beside it (a rank's share samples what one process samples); None: one draw over the batch from torch's RNG."""

    def __init__(self, seeds: Optional[list[int]] = None):
        self.rows = None if seeds is None else [torch.Generator().manual_seed(seed) for seed in seeds]

    def uniforms(self, n: int, device) -> torch.Tensor:
        """[n] float64 uniforms, one per row."""
        if self.rows is None:
            return torch.rand((n, 1), dtype=torch.float64, device=device)[:, 0]
        # why on the CPU: a CPU generator's stream is the same on every device; n draws, one copy per step
        return torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in self.rows]).to(device)

    def draw(self, scores: torch.Tensor, buffers: RowBuffers) -> torch.Tensor:
        """[n, 1] tokens drawn from softmax(scores), a block of rows at a time in `buffers`."""
        u, tokens = self.uniforms(scores.shape[0], scores.device)[:, None], []
        for i, j in buffers.blocks(scores.shape[0]):
            torch.ops.aten._softmax.out(scores[i:j], -1, False, out=buffers.row[: j - i])
            cdf = buffers.cdf[: j - i].copy_(buffers.row[: j - i]).cumsum_(-1)
            total = cdf[:, -1:]
            if not torch.isfinite(total).all() or (total <= 0).any():
                raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
            tokens.append(torch.searchsorted(cdf, u[i:j] * total, right=True))  # the first cdf > u: a token of p > 0
        return torch.cat(tokens).clamp_(max=scores.shape[-1] - 1)


class SampledLogprobs:
    """Records log_softmax(scores) at each step's chosen token, a block of rows at a time in RowBuffers; the scores are
    those sampled from (after `sampling_processors`: filtered tokens at -inf). (`output_scores=True` would keep every
    step's [n, V] scores: O(n x length x vocab).) The log-probs go into one [steps, n] buffer made at the first call
    (doubled if a call runs past `steps`). Why not a [n] tensor per step: each lived to the rollout's end, and glibc
    carved such small blocks out of the freed [n, V] blocks' holes, so no [n, V] block fitted a hole again and the heap
    grew by one a step (docs/benchmarks.md, "The rollout's heap holes at glibc's own threshold")."""

    def __init__(self, steps: int = 64):
        self.recorded: Optional[torch.Tensor] = None  # [>= steps, n] float32: row t is step t's tokens' log-probs
        self.steps, self.count = steps, 0

    def _next(self, scores: torch.Tensor) -> torch.Tensor:
        """This step's [n] row of the buffer (made, or doubled, when full)."""
        if self.recorded is None or self.count == self.recorded.shape[0]:
            shape = (max(self.steps, 2 * self.count), scores.shape[0])
            grown = torch.empty(shape, dtype=torch.float32, device=scores.device)
            if self.recorded is not None:
                grown[: self.count] = self.recorded
            self.recorded = grown
        self.count += 1
        return self.recorded[self.count - 1]

    def record(self, scores: torch.Tensor, tokens: torch.Tensor, buffers: RowBuffers) -> None:
        column = self._next(scores)
        for i, j in buffers.blocks(scores.shape[0]):
            out = buffers.row[: j - i]
            torch.ops.aten._log_softmax.out(scores[i:j].float(), -1, False, out=out)
            torch.gather(out, -1, tokens[i:j], out=column[i:j, None])

    def finish(self, new_tokens) -> torch.Tensor:
        """[n, T] log-probs of `new_tokens`, the rows' chosen tokens (a row generate() pads after its stop token keeps
        the log-prob of the token it would have chosen there: its completion ends at the stop token)."""
        count, recorded = min(self.count, new_tokens.shape[1]), self.recorded
        self.recorded, self.count = None, 0
        if not count:
            return torch.zeros(new_tokens.shape, dtype=torch.float32)
        return recorded[:count].t().contiguous()


class DecodeStep:
    """The logits processor placed after `sampling_processors`: the step's token per row (the sampler's draw, or the
    argmax when greedy), its log-prob recorded, and the scores written over so that generate()'s greedy choice takes
    that token. Why over its input: transformers hands each step a float32 copy of the logits that nothing else
    reads (no output_scores / output_logits; on a CPU learner a view of the kept logits, generation/step_logits.py),
    so returning a new [rows, vocab] tensor would only add one."""

    def __init__(self, recorder: SampledLogprobs, sampler: Optional[InverseCdfSampler] = None):
        self.recorder, self.sampler, self.buffers = recorder, sampler, RowBuffers()
        self.scores: Optional[torch.Tensor] = None  # the step's, until generate() has chosen from them

    def __call__(self, input_ids, scores):
        buffers = self.buffers.ready(scores)
        self.scores = scores
        if self.sampler is None:  # greedy: generate()'s own argmax (the first of equal maxima), scores left as they are
            tokens = scores.argmax(-1, keepdim=True)
            self.recorder.record(scores, tokens, buffers)
            return scores
        tokens = self.sampler.draw(scores, buffers)
        self.recorder.record(scores, tokens, buffers)
        return scores.fill_(float("-inf")).scatter_(-1, tokens, 0.0)

    def release(self, input_ids, scores, **kwargs) -> torch.Tensor:
        """A stopping criterion that stops nothing: generate() has taken its token from the step's scores when its
        stopping criteria run, so their storage is let go here (`set_()`: every name generate() holds them by now
        points at an empty tensor). Why: generate() keeps them until the next step's logits are copied, one more
        [rows, vocab] float32 through each forward (4.6 MiB at 8 x Qwen2.5's vocabulary)."""
        if self.scores is not None:
            self.scores.set_()
            self.scores = None
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class InPlace:
    """A transformers logits processor whose result is written over its input (the same values: its temporaries freed
    as it returns), so the scores generate() holds through a step stay its logits' copy."""

    def __init__(self, processor):
        self.processor = processor

    def __call__(self, input_ids, scores):
        return scores.copy_(self.processor(input_ids, scores))
