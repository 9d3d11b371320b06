"""Importance-sampling correction for a generator that is not the learner, as TRL 1.16's
`vllm_importance_sampling_correction` computes it (GRPOTrainer._generate_and_score_completions):

    diff  = (learner log-prob before the update - sampler log-prob) over completion tokens
    ratio = exp(diff) per token (token_*) or exp(sum of diff over the completion) per sequence (sequence_*)
    *_truncate: ratio clipped to [clip_min, clip_max];  *_mask: ratio set to 0 outside [clip_min, clip_max]

The weight multiplies the clipped surrogate per token (before the KL term is added), once per rollout:
every update of the rollout (`num_iterations`) uses the same weights. Whether it applies at all is the
backend's call: only a generator with its own weights (registry.OWN_WEIGHTS) samples from a policy that
can differ from the learner's.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch


def _truncate(ratio, clip_min, clip_max):
    return torch.clamp(ratio, min=clip_min, max=clip_max)


def _mask(ratio, clip_min, clip_max):
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


# mode -> (per-sequence?, bound rule)
MODES: dict[str, tuple[bool, Callable]] = {
    "token_truncate": (False, _truncate),
    "token_mask": (False, _mask),
    "sequence_truncate": (True, _truncate),
    "sequence_mask": (True, _mask),
}


def importance_weights(
    learner_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    mode: str,
    clip_min: Optional[float],
    clip_max: Optional[float],
) -> torch.Tensor:
    """[N, L] (token_*) or [N, 1] (sequence_*) weights; `learner_logps` is the learner before this rollout's
    first update (detached), `sampler_logps` what the generator recorded, both [N, L]."""
    per_sequence, bound = MODES[mode]
    # a NaN sampler log-prob: no correction
    diff = torch.nan_to_num((learner_logps - sampler_logps) * completion_mask, nan=0.0)
    if per_sequence:
        diff = diff.sum(dim=-1, keepdim=True)
    return bound(torch.exp(diff), clip_min, clip_max)
