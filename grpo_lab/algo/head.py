"""The log-prob head: log softmax(hidden @ W.T / T)[target] for the completion tokens only, a chunk
of positions at a time, with each chunk's logits recomputed in backward instead of stored.

Why: with 128k-152k vocabularies the logits are the largest tensor of a GRPO step ([B, L, V] in
float32 is 4.9 GB for 8 x 1024 tokens of Qwen2.5). Here at most one chunk of them exists, forward
or backward: `chunk` x V floats (plus its compute-dtype matmul output when that is not float32).
The softmax of backward is done in place in that buffer. TRL's fused head (trl.kernels.chunked_logprob)
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
        low_rank = (lora_in, lora_b)
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        log_z = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            logits = _logits(hidden[rows], weight, bias, temperature, low_rank, rows)  # [c, V] float32: the peak
            target = logits.gather(1, targets[rows].unsqueeze(1)).squeeze(1)
            top = logits.amax(dim=1)
            sum_exp = logits.sub_(top.unsqueeze(1)).exp_().sum(dim=1)  # in place: no second [c, V]
            log_z[rows] = top + sum_exp.log()
            logprobs[rows] = target - log_z[rows]
            del logits  # why: free this chunk before the next one's matmul allocates, else two chunks are alive
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, lora_in, lora_b)
        ctx.temperature, ctx.chunk = temperature, chunk
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
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, hidden.shape[0]))
            g = grad[rows].unsqueeze(1)
            # d log p_t / d z_j = 1[j = t] - p_j, and z = logits / T: built in the recomputed logits' own buffer
            dz = _logits(hidden[rows], weight, bias, ctx.temperature, (lora_in, lora_b), rows)
            dz = dz.sub_(log_z[rows].unsqueeze(1)).exp_().mul_(-g)
            dz.scatter_add_(1, targets[rows].unsqueeze(1), g)
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)
            if need_hidden:
                grad_hidden[rows] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_weight:
                grad_weight.addmm_(dz.t(), hidden[rows].float())
            if need_bias:
                grad_bias += dz.sum(dim=0)
            if need_in:
                grad_in[rows] = (dz.to(lora_b.dtype) @ lora_b).to(lora_in.dtype)
            if need_b:
                grad_b.addmm_(dz.t(), lora_in[rows].float())
            del dz  # why: free this chunk before the next one's matmul allocates, else two chunks are alive
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


def _logits(hidden, weight, bias, temperature: float, low_rank=(None, None), rows=slice(None)) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias).float()
    lora_in, lora_b = low_rank
    if lora_in is not None:  # a LoRA on the head: this chunk's [c, r] @ [r, V], added in place
        logits.addmm_(lora_in[rows].float(), lora_b.float().t())
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
