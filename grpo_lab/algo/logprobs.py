"""Per-token log-probs of completions, micro-batched.

The backbone runs on prompt + completion; the head (algo/head.py, `grpo.logprob_head`) is applied to
the hidden states of the completion tokens only (the padding after EOS and the prompt are never
scored), a chunk of positions at a time (`grpo.logprob_chunk_size`), and returns log-probs
directly: neither the [batch, length, vocab] logits nor more than one chunk of them ever exist,
forward or backward (the logits peak is the largest transient of a GRPO step on large vocabularies).
Departs from TRL in one detail: position ids follow the attention mask (as in `generate`),
so a left-padded prompt is scored at the positions it was sampled at.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import Iterator, Optional

import torch

from .containers import Rollout
from .head import chunked_logprobs, full_logprobs, trl_logprobs

# grpo.logprob_head: name -> kernel
HEADS = {"chunked": chunked_logprobs, "trl": trl_logprobs, "full": full_logprobs}


@dataclass
class HeadSettings:
    """How the next log-prob pass scores: the rollout's temperature, the chunk and the kernel (set per pass)."""

    temperature: float = 1.0
    chunk_size: int = 128
    kernel: str = "chunked"


def add_logprob_head(model, temperature: float = 1.0, autocast: Optional[torch.dtype] = None) -> None:
    """Give a (not yet PEFT-wrapped) causal LM its head settings; `completion_logprobs` reads them. `autocast`: the
    dtype its forward passes run under torch.autocast at (models/learner.autocast_dtype), or None."""
    model._grpo_lab_head = HeadSettings(temperature)
    model._grpo_lab_autocast = autocast
    text = model.config.get_text_config()
    softcap, scale = getattr(text, "final_logit_softcapping", None), getattr(text, "logit_scale", None)
    # why: the chunked kernel is a plain linear head; a model that caps or scales its logits is scored by TRL's,
    # which does both (Gemma 2, Cohere)
    model._grpo_lab_scaling = (
        (softcap, 1.0 if scale is None else scale) if softcap or scale not in (None, 1.0) else None
    )


def _base(model):
    """The causal LM under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def precision(model):
    """The context the model's forward passes run in: torch.autocast at its `autocast` dtype (add_logprob_head), as
    TRL's do under accelerate's mixed precision; a no-op for a model without one."""
    base = _base(model)
    dtype = getattr(base, "_grpo_lab_autocast", None)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(base.device.type, dtype=dtype)


def _settings(model) -> HeadSettings:
    return _base(model)._grpo_lab_head


def set_logprob_head(
    model, temperature: Optional[float] = None, chunk_size: Optional[int] = None, kernel: Optional[str] = None
) -> None:
    """Set what the next passes score with (None keeps a setting). Why temperature per rollout: log-probs
    must be taken at the temperature the rollout was sampled at, whatever generator.temperature says now."""
    head = _settings(model)
    head.temperature = head.temperature if temperature is None else temperature
    head.chunk_size = head.chunk_size if chunk_size is None else chunk_size
    head.kernel = head.kernel if kernel is None else kernel


def configure_head(model, config, temperature: float) -> None:
    """The head settings of `config` (grpo.logprob_chunk_size, grpo.logprob_head), at `temperature`."""
    set_logprob_head(model, temperature, config.grpo.logprob_chunk_size, config.grpo.logprob_head)


def micro_batches(n: int, size: Optional[int], within: Optional[slice] = None) -> Iterator[slice]:
    """Slices of `size` rows covering range(n) (or the rows `within`: a sharded rank's own); the last may be
    partial; None = one slice."""
    first, end = (0, n) if within is None else (within.start, within.stop)
    size = size or (end - first)
    for start in range(first, end, size):
        yield slice(start, min(start + size, end))


# whether a pass scores completions (the policy's, the reference's): its layers run as the training forward does, so
# the reference's log-probs are computed as the policy's are (models/experts_gemv.py keeps its kernel to rollouts)
SCORING: ContextVar[bool] = ContextVar("grpo_lab_scoring", default=False)


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    """Log-prob of every completion token under `model`: [n, L] (0 where completion_mask is 0). Inputs must be
    on the model's device."""
    base = _base(model)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [n, P+L]
    attention = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    mask = completion_mask.bool()
    # a sharded model runs the pass through its registered method, so FSDP gathers the root's embedding and head
    score = getattr(base, "grpo_lab_score", None) or partial(score_completions, base)
    scoring = SCORING.set(True)
    try:
        per_token = score(input_ids, attention, position_ids, completion_ids, mask)
    finally:
        SCORING.reset(scoring)
    # masked_scatter keeps the result connected to the graph even when no token is real
    return per_token.new_zeros(mask.shape).masked_scatter(mask, per_token)


def score_completions(base, input_ids, attention, position_ids, completion_ids, mask) -> torch.Tensor:
    """The backbone over prompt + completion, then the head on the real completion tokens only: [tokens]."""
    head = base._grpo_lab_head
    width = completion_ids.shape[1]
    backbone = getattr(base, base.base_model_prefix)  # the decoder without its LM head (PEFT's LoRA layers inside)
    with precision(base):  # why only the backbone: the head kernels pick their own dtypes (float32 logits)
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention, position_ids=position_ids, use_cache=False
        ).last_hidden_state[:, -width - 1 : -1]  # position t predicts token t + 1
    lm_head = base.get_output_embeddings()
    # why compact rows: only real completion tokens reach the head (no prompt, no padding after EOS)
    hidden = hidden[mask]
    adapter = head_adapter(lm_head, hidden)
    linear = getattr(lm_head, "base_layer", lm_head)  # a PEFT LoRA layer wraps the head's own Linear
    rows = (hidden, linear.weight, linear.bias, completion_ids[mask], head.temperature, head.chunk_size)
    scaling = base._grpo_lab_scaling
    if adapter is not None:
        if scaling or head.kernel != "chunked":
            from ..errors import LabError

            raise LabError(
                "lora.target_modules: a LoRA on lm_head is applied by grpo_lab's chunked head only (not by "
                "grpo.logprob_head: trl or full, nor for a model that caps or scales its logits); drop lm_head from "
                "the targets or use grpo.logprob_head: chunked"
            )
        return chunked_logprobs(*rows, *adapter)
    return trl_logprobs(*rows, *scaling) if scaling else HEADS[head.kernel](*rows)


def head_adapter(lm_head, hidden) -> Optional[tuple]:
    """A PEFT LoRA on the head, active now: (A(dropout(hidden)) x scaling [M, r], B [V, r]), as PEFT's forward adds
    it (with graph: A and B get their gradients); None for a plain head, or one whose adapter is disabled (the
    reference pass) or merged."""
    if (
        not hasattr(lm_head, "lora_A")
        or getattr(lm_head, "disable_adapters", False)
        or getattr(lm_head, "merged", False)
    ):
        return None
    active = [a for a in lm_head.active_adapters if a in lm_head.lora_A]
    if not active:
        return None
    if len(active) > 1 or lm_head.use_dora.get(active[0], False):
        from ..errors import LabError

        raise LabError(
            "lora.target_modules: the chunked head applies one plain LoRA adapter on lm_head (not DoRA, not "
            "several at once); drop lm_head from the targets"
        )
    name = active[0]
    a, b = lm_head.lora_A[name], lm_head.lora_B[name]
    lora_in = a(lm_head.lora_dropout[name](hidden.to(a.weight.dtype))) * lm_head.scaling[name]  # [M, r]
    return lora_in, b.weight


def rollout_slice(rollout: Rollout, rows: slice, device) -> tuple[torch.Tensor, ...]:
    """One micro-batch's inputs on `device` (moved here, one micro-batch at a time)."""
    return tuple(
        t[rows].to(device)
        for t in (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
    )


@torch.no_grad()  # why: reference log-probs are constants of the loss, no graph is kept
def rollout_logprobs(
    model, rollout: Rollout, device, micro_batch_size: Optional[int], out_device="cpu", sharding=None
) -> torch.Tensor:
    """Log-probs of every completion of the rollout under `model` at the rollout's temperature,
    micro-batched: [N, L] on `out_device` (each rank of a sharded learner scores its own rows). `sharding`: the
    learner's (Learner.sharding; None: a model no rank shares)."""
    from ..runtime import runtime

    agreed = contextlib.nullcontext if sharding is None else sharding.agreed
    set_logprob_head(model, temperature=rollout.logprob_temperature)
    parts, ranks = [], runtime()
    for rows in micro_batches(len(rollout), micro_batch_size, ranks.rows(len(rollout))):
        with agreed(model):  # a failure on any rank stops every rank's pass here, FSDP reset
            parts.append(completion_logprobs(model, *rollout_slice(rollout, rows, device)).float().to(out_device))
    return ranks.gather_rows(torch.cat(parts, dim=0))  # a sharded rank scores its rows; every rank gets them all
