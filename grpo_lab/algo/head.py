"""The log-prob head: log softmax(hidden @ W.T / T)[target] for the completion tokens only, a chunk
of positions at a time, with each chunk's logits recomputed in backward instead of stored.

Why: with 128k-152k vocabularies the logits are the largest tensor of a GRPO step ([B, L, V] in
float32 is 4.9 GB for 8 x 1024 tokens of Qwen2.5). Here at most one chunk of them exists, forward
or backward: `chunk` x V floats (plus its compute-dtype matmul output when that is not float32).
The softmax of backward is done in place in that buffer, and each pass (forward, backward) writes every chunk into the
same held buffers (`ChunkBuffers`): no chunk allocates one of its own, so on the CPU no freed chunk is left as a heap
hole that the next chunk does not fit (glibc's own mmap threshold serves blocks under 32 MiB from its heap).
TRL's fused head (trl.kernels.chunked_logprob)
tiles [4096 positions x 32768 vocab] and, off Triton, scores every position (prompt included) with
several tile-sized temporaries per fold: ~8.5 vocabulary tiles at once on the CPU (as measured on the CPU).
"""

from __future__ import annotations

from typing import Optional

import torch

from .room import before_allocating


class ChunkedSelectiveLogProbs(torch.autograd.Function):
    """Per-row log-prob of `targets` under logits = (hidden @ weight.T + bias) / temperature, `chunk` rows at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk: int, lora_in=None, lora_b=None):
        """`lora_in` [M, r] (the adapter's A(dropout(hidden)) x scaling) and `lora_b` [V, r]: a LoRA on the head,
        whose logits are hidden @ W.T + lora_in @ B.T, added a chunk at a time (never a [M, V] delta)."""
        n = hidden.shape[0]
        low_rank = (lora_in, None if lora_b is None else lora_b.float())  # (once a pass, not once a chunk)
        buffers = ChunkBuffers(min(chunk, n), weight)
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        log_z = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            logits = _logits(hidden[rows], weight, bias, temperature, low_rank, rows, buffers)  # [c, V]: the peak
            target = logits.gather(1, targets[rows].unsqueeze(1)).squeeze(1)
            top = logits.amax(dim=1)
            sum_exp = logits.sub_(top.unsqueeze(1)).exp_().sum(dim=1)  # in place: no second [c, V]
            log_z[rows] = top + sum_exp.log()
            logprobs[rows] = target - log_z[rows]
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, lora_in, lora_b)
        ctx.temperature, ctx.chunk = temperature, chunk
        # why kept for backward (which runs next, the loss between): its chunks reuse the same blocks rather than
        # new ones that the blocks freed here, split by the small tensors made in between, would no longer fit
        ctx.buffers = buffers if any(ctx.needs_input_grad) else None
        return logprobs

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets, log_z, lora_in, lora_b = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_in, need_b = ctx.needs_input_grad[6:8]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        grad_in = torch.empty_like(lora_in) if need_in else None
        grad_b = torch.zeros(lora_b.shape, dtype=torch.float32, device=lora_b.device) if need_b else None
        grad = grad.float()
        buffers, ctx.buffers = ctx.buffers or ChunkBuffers(min(ctx.chunk, hidden.shape[0]), weight), None
        low_rank = (lora_in, None if lora_b is None else lora_b.float())  # (once a pass, not once a chunk)
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, hidden.shape[0]))
            g = grad[rows].unsqueeze(1)
            # d log p_t / d z_j = 1[j = t] - p_j, and z = logits / T: built in the recomputed logits' own buffer
            dz = _logits(hidden[rows], weight, bias, ctx.temperature, low_rank, rows, buffers)
            dz = dz.sub_(log_z[rows].unsqueeze(1)).exp_().mul_(-g)
            dz.scatter_add_(1, targets[rows].unsqueeze(1), g)
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)
            if need_hidden:  # (dz in the weight's dtype: written into the matmul's buffer, as .to() would make it)
                grad_hidden[rows] = (buffers.as_weight(dz) @ weight).to(hidden.dtype)
            if need_weight:
                grad_weight.addmm_(dz.t(), hidden[rows].float())
            if need_bias:
                grad_bias += dz.sum(dim=0)
            if need_in:
                grad_in[rows] = (dz.to(lora_b.dtype) @ lora_b).to(lora_in.dtype)
            if need_b:
                grad_b.addmm_(dz.t(), lora_in[rows].float())
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            grad_in,
            None if grad_b is None else grad_b.to(lora_b.dtype),
        )


class ChunkBuffers:
    """One pass's [chunk, V] buffers: the float32 logits and, where the weight is not float32, the matmul's output in
    the weight's dtype. Every chunk is written into them (a last, shorter chunk into their first rows)."""

    def __init__(self, rows: int, weight: torch.Tensor):
        self.logits = torch.empty(rows, weight.shape[0], dtype=torch.float32, device=weight.device)
        low = weight.dtype != torch.float32
        self.low = torch.empty(rows, weight.shape[0], dtype=weight.dtype, device=weight.device) if low else None

    def as_weight(self, dz: torch.Tensor) -> torch.Tensor:
        """`dz` (float32, [c, V]) in the weight's dtype: the same values `dz.to(weight.dtype)` makes."""
        return dz if self.low is None else self.low[: dz.shape[0]].copy_(dz)


def _logits(hidden, weight, bias, temperature: float, low_rank, rows, buffers: ChunkBuffers) -> torch.Tensor:
    """This chunk's float32 logits, in `buffers`: F.linear's own kernels (addmm with a bias, mm without) written there,
    so the same bits as `F.linear(hidden, weight, bias).float()`."""
    c = hidden.shape[0]
    out = buffers.logits[:c] if buffers.low is None else buffers.low[:c]
    x = hidden.to(weight.dtype)
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)
    logits = out if buffers.low is None else buffers.logits[:c].copy_(out)
    lora_in, lora_b = low_rank
    if lora_in is not None:  # a LoRA on the head: this chunk's [c, r] @ [r, V] (lora_b in float32), added in place
        logits.addmm_(lora_in[rows].float(), lora_b.t())
    return logits.div_(temperature) if temperature != 1.0 else logits


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    temperature: float,
    chunk: int,
    lora_in: Optional[torch.Tensor] = None,
    lora_b: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """[M, H] hidden states and [M] targets -> [M] float32 log-probs (`lora_in` [M, r], `lora_b` [V, r]: a LoRA on
    the head, see ChunkedSelectiveLogProbs.forward)."""
    return ChunkedSelectiveLogProbs.apply(hidden, weight, bias, targets, temperature, chunk, lora_in, lora_b)


def trl_logprobs(hidden, weight, bias, targets, temperature: float, chunk: int, softcap=None, logit_scale=1.0):
    """TRL's fused head kernel on the same compact rows (Triton on CUDA; torch tiles elsewhere)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    return ChunkedLogProbFunction.apply(
        hidden, weight, bias, targets, temperature, _CHUNKED_LOGPROB_CHUNK_SIZE, softcap, logit_scale, ()
    )[0]


# float32 [M, V] buffers the textbook head holds at its peak: with a graph, the backward's (the planner's
# FULL_HEAD_FLOAT32_COPIES, measured 12.07 bytes per logit); without one, the logits and their log-softmax
FULL_HEAD_COPIES = {True: 3, False: 2}


def full_logprobs(hidden, weight, bias, targets, temperature: float, chunk: int):
    """The textbook pass, for comparison: every row's logits at once ([M, V] in float32) and their log-softmax,
    which autograd keeps for backward: the [B, L, V] peak the chunked head exists to avoid (`chunk` is unused).
    Its size is said first (algo/room.py): the backward over it is one native call the live guard cannot stop."""
    copies = FULL_HEAD_COPIES[torch.is_grad_enabled()]
    what = f"the full head's {copies} float32 [rows, vocab] buffers"
    before_allocating(copies * hidden.shape[0] * weight.shape[0] * 4, what)
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    # why a copy of the [M] result: FSDP2 warns of a sharded root's output that is a view (squeeze's would be one)
    return logits.log_softmax(-1).gather(1, targets.unsqueeze(1)).squeeze(1).clone()
