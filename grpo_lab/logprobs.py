"""Per-token log-probs of completions, micro-batched.

Uses TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`): the head is applied in tiles
to the completion positions only and returns log-probs directly, so neither the
[batch, length, vocab] logits nor their float32 log-softmax ever exist at once (the logits peak
is the largest transient of a GRPO step on large vocabularies).
Departs from TRL in one detail: position ids follow the attention mask (as in `generate`),
so a left-padded prompt is scored at the positions it was sampled at.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from .types import Rollout


def add_logprob_head(model, temperature: float = 1.0) -> None:
    """Patch a (not yet PEFT-wrapped) causal LM so `fused_lm_head=True` returns log-probs."""
    model._grpo_lab_forward = model.forward   # the model's own forward, to re-patch from
    model._grpo_lab_temperature = None
    set_logprob_temperature(model, temperature)


def set_logprob_temperature(model, temperature: float) -> None:
    """Score at `temperature`. TRL's fused head bakes its temperature in, so a new one re-patches the
    forward (cheap: no weight moves). Why per rollout: log-probs must be taken at the temperature the
    rollout was sampled at, whatever generator.temperature says now."""
    from trl.trainer.utils import add_fused_lm_head

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if base._grpo_lab_temperature == temperature:
        return
    base.forward = base._grpo_lab_forward
    add_fused_lm_head(base, temperature=temperature)
    base._grpo_lab_temperature = temperature


def micro_batches(n: int, size: Optional[int]) -> Iterator[slice]:
    """Slices of `size` rows covering range(n); the last may be partial; None = one slice."""
    size = size or n
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    """Log-prob of every completion token under `model`: [n, L]. Inputs must be on the model's device."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)                  # [n, P+L]
    attention = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    width = completion_ids.shape[1]
    labels = input_ids.masked_fill(attention == 0, -100)
    labels[:, :-width] = -100  # why: score only completion tokens; the head never runs on prompt positions
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids,
                labels=labels, fused_lm_head=True)
    return out.log_probs[:, -width:]


def rollout_slice(rollout: Rollout, rows: slice, device) -> tuple[torch.Tensor, ...]:
    """One micro-batch's inputs on `device` (moved here, one micro-batch at a time)."""
    return tuple(t[rows].to(device) for t in
                 (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask))


@torch.no_grad()  # why: reference log-probs are constants of the loss, no graph is kept
def rollout_logprobs(model, rollout: Rollout, device, micro_batch_size: Optional[int],
                     out_device="cpu") -> torch.Tensor:
    """Log-probs of every completion of the rollout under `model` at the rollout's temperature,
    micro-batched: [N, L] on `out_device`."""
    set_logprob_temperature(model, rollout.logprob_temperature)
    parts = []
    for rows in micro_batches(len(rollout), micro_batch_size):
        parts.append(completion_logprobs(model, *rollout_slice(rollout, rows, device)).float().to(out_device))
    return torch.cat(parts, dim=0)
