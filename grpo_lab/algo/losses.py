"""GRPO's clipped surrogate and the loss normalisations, as a registry keyed by TRL's `loss_type`.

Departure from TRL: a loss here is normalised over the whole step batch, so splitting it
into micro-batches (to fit memory) never changes the objective or the gradient. TRL's `bnpo`
normalises per micro-batch; here it equals `dapo` on one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class BatchTotals:
    """Whole-batch figures every micro-batch normalises by."""

    num_sequences: int  # B*G
    num_tokens: int  # completion tokens in the loss mask, whole batch
    max_completion_length: int


def token_log_ratio(logps, old_logps, mask):
    """log(learner / old) per token: [N, L]."""
    return logps - old_logps


def sequence_log_ratio(logps, old_logps, mask):
    """GSPO: the mean of each completion's token log-ratios over its loss mask, one per sequence: [N, 1]."""
    return (((logps - old_logps) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


# grpo.importance_sampling_level (TRL's name): the level at which the PPO ratio is taken and clipped
RATIO_LEVELS: dict[str, Callable] = {"token": token_log_ratio, "sequence": sequence_log_ratio}


def clipped_surrogate(logps, old_logps, advantages, epsilon_low, epsilon_high, mask=None, level: str = "token"):
    """Per-token -min(r*A, clip(r)*A), where the clip was active, and the ratio r ([N, L], or [N, 1] at the sequence
    level).  logps/old/mask: [N, L], advantages: [N]."""
    ratio = torch.exp(RATIO_LEVELS[level](logps, old_logps, mask))
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    adv = advantages.unsqueeze(1)  # [N, 1]
    per_token = -torch.min(ratio * adv, clipped * adv)
    is_clipped = ((ratio < 1 - epsilon_low) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
    return per_token, is_clipped, ratio


def kl_k3(logps, ref_logps):
    """Schulman's k3 estimator of KL(policy || reference), per token (TRL's choice)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def _grpo(per_token, mask, totals: BatchTotals):
    per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_seq.sum() / totals.num_sequences


def _token_mean(per_token, mask, totals: BatchTotals):
    return (per_token * mask).sum() / max(totals.num_tokens, 1)


def _dr_grpo(per_token, mask, totals: BatchTotals):
    return (per_token * mask).sum() / (totals.num_sequences * totals.max_completion_length)


LOSSES: dict[str, Callable] = {
    "grpo": _grpo,  # mean over tokens of each sequence, then over sequences
    "bnpo": _token_mean,  # mean over all completion tokens of the batch
    "dr_grpo": _dr_grpo,  # sum over tokens / (sequences x max_completion_length): no length bias
    "dapo": _token_mean,  # mean over all completion tokens of the whole generation batch
}


@dataclass(frozen=True)
class LossSettings:
    """The objective's settings, read from the config once per backward (TRL's names)."""

    loss_type: str  # a key of LOSSES: how the per-token loss is normalised
    beta: float  # the KL term's weight (0: no reference)
    epsilon_low: float  # the ratio's clip below 1
    epsilon_high: float  # the ratio's clip above 1
    bias_correction_kl: bool = False  # the KL term weighted by the ratio, as TRL's default
    level: str = "token"  # a key of RATIO_LEVELS: where the ratio is taken and clipped

    @classmethod
    def from_config(cls, config) -> "LossSettings":
        grpo = config.grpo
        return cls(
            grpo.loss_type,
            grpo.beta,
            grpo.epsilon,
            config.epsilon_high,
            grpo.use_bias_correction_kl,
            grpo.importance_sampling_level,
        )


def grpo_loss(
    logps,
    old_logps: Optional[torch.Tensor],
    ref_logps: Optional[torch.Tensor],
    advantages,
    mask,
    totals: BatchTotals,
    settings: LossSettings,
    sampling_weights: Optional[torch.Tensor] = None,
):
    """The micro-batch's share of the step loss, plus per-token KL (as weighted in the loss) and clip flags
    (per sequence at the sequence level: [N, 1]). logps/old/ref/mask/sampling_weights: [N, L]; advantages: [N]."""
    s = settings
    old = logps.detach() if old_logps is None else old_logps  # on-policy: ratio 1, gradient of r*A
    per_token, is_clipped, ratio = clipped_surrogate(
        logps, old, advantages, s.epsilon_low, s.epsilon_high, mask, s.level
    )
    if sampling_weights is not None:
        per_token = per_token * sampling_weights
    kl = None
    if s.beta != 0.0:
        kl = kl_k3(logps, ref_logps)
        if s.bias_correction_kl:  # TRL's default: ratio-weighted (differentiable, so it moves the gradient at ratio 1)
            kl = kl * ratio  # at the ratio's level, as TRL (a sequence's ratio for every token of it)
        per_token = per_token + s.beta * kl
    return LOSSES[s.loss_type](per_token, mask, totals), kl, is_clipped
