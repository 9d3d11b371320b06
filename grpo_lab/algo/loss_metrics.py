"""A backward phase's metrics, summed over its micro-batches and then over the ranks: the loss, the KL term, the clip
fraction, the sampler/learner log-prob mismatch and the importance-sampling ratio's range (TRL logs the same ones)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .containers import LossStats
from .losses import BatchTotals


@dataclass
class LossSums:
    """Sums over the micro-batches this process ran (a sharded rank: its rows)."""

    loss: float = 0.0
    kl: float = 0.0  # the KL term over the loss mask
    clipped: float = 0.0  # tokens (or sequences' tokens) where the clip was active
    mismatch: float = 0.0  # |log(learner / sampler)| over the tokens the sampler scored
    mismatch_kl: float = 0.0  # k3 estimate of KL(sampler || learner) over the same tokens
    mismatch_tokens: float = 0.0

    def add(self, loss: float, kl: Optional[torch.Tensor], clipped, mask, gap, seen) -> None:
        """One micro-batch: its loss value, KL [N, L] (or None), clip flags, loss mask, learner-sampler gap and the
        tokens where the gap is known (all [N, L])."""
        self.loss += loss
        self.mismatch += (gap.abs() * seen).sum().item()
        self.mismatch_kl += ((torch.exp(gap) - gap - 1) * seen).sum().item()
        self.mismatch_tokens += seen.sum().item()
        self.clipped += (clipped.float() * mask).sum().item()
        if kl is not None:
            self.kl += (kl.detach() * mask).sum().item()

    def stats(self, ranks, totals: BatchTotals, beta: float, is_weights, loss_mask) -> LossStats:
        """The whole batch's metrics: every rank's sums added (`ranks.sum`), per token of the loss mask."""
        loss, kl, clipped, mismatch, mismatch_kl, seen = ranks.sum(
            [self.loss, self.kl, self.clipped, self.mismatch, self.mismatch_kl, self.mismatch_tokens]
        )
        tokens = max(totals.num_tokens, 1)
        return LossStats(
            loss=loss,
            kl=kl / tokens if beta > 0 else None,
            clip_fraction=clipped / tokens,
            logprob_mismatch=mismatch / max(seen, 1),
            logprob_kl=mismatch_kl / max(seen, 1),
            num_tokens=totals.num_tokens,
            **ratio_stats(is_weights, loss_mask),
        )


def learner_sampler_gap(old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor):
    """log(learner / sampler) per token [N, L], and the loss-mask tokens where it is known (a sampler log-prob the
    engine did not return stays out of the metrics)."""
    gap = old - sampler
    seen = mask * torch.isfinite(gap)
    return torch.nan_to_num(gap, nan=0.0, posinf=0.0, neginf=0.0), seen


def ratio_stats(weights: Optional[torch.Tensor], loss_mask: torch.Tensor) -> dict:
    """Min/mean/max of the importance-sampling weights, as TRL logs them (token modes: over the loss's tokens)."""
    if weights is None:
        return {}
    flat = weights.flatten() if weights.shape[1] == 1 else weights[loss_mask.bool()]
    if not flat.numel():
        return {}
    return {"is_ratio_min": flat.min().item(), "is_ratio_mean": flat.mean().item(), "is_ratio_max": flat.max().item()}
