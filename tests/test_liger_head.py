"""The head choice, pinned (issue 49): liger-kernel's fused linear GRPO loss (`LigerFusedLinearGRPOLoss`, the field's
well-kept one) and grpo_lab's own chunked head with its loss give the same loss and the same gradients (hidden states
and the LM head's weight, so every LoRA gradient behind them) to 1e-5, for every loss type the lab offers, on and off
policy, with and without the KL term, at the token and the sequence level, at a sampling temperature, on completions
of different lengths. bench/probes/liger_head.py measures what each costs (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from grpo_lab.algo.head import chunked_logprobs
from grpo_lab.algo.losses import LOSSES, BatchTotals, LossSettings, grpo_loss

liger = pytest.importorskip("liger_kernel.chunked_loss")

ROWS, LENGTH, HIDDEN, VOCAB = 6, 12, 32, 211
LENGTHS = [12, 3, 7, 12, 1, 9]  # varied: a normalisation by the wrong count differs


def problem(off_policy: bool, beta: float, temperature: float):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(ROWS, LENGTH, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5
    targets = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    mask = (torch.arange(LENGTH)[None] < torch.tensor(LENGTHS)[:, None]).float()
    advantages = torch.randn(ROWS, generator=g)
    with torch.no_grad():
        now = lab_logprobs(hidden, weight, targets, temperature)
    old = now + 0.3 * torch.randn(ROWS, LENGTH, generator=g) if off_policy else None  # ratios clipped both ways
    ref = now + 0.2 * torch.randn(ROWS, LENGTH, generator=g) if beta else None
    return hidden, weight, targets, mask, advantages, old, ref


def lab_logprobs(hidden, weight, targets, temperature):
    return chunked_logprobs(hidden.reshape(-1, HIDDEN), weight, None, targets.reshape(-1), temperature, 16).reshape(
        ROWS, LENGTH
    )


@pytest.mark.parametrize("loss_type", sorted(LOSSES))
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("off_policy", [False, True], ids=["on-policy", "off-policy"])
@pytest.mark.parametrize("level, temperature", [("token", 0.7), ("sequence", 1.0)])
def test_ligers_fused_grpo_loss_equals_the_labs_head_and_loss(loss_type, beta, off_policy, level, temperature):
    hidden, weight, targets, mask, advantages, old, ref = problem(off_policy, beta, temperature)
    settings = LossSettings(loss_type, beta, 0.2, 0.28, False, level)
    results = {}
    for side in ("lab", "liger"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if side == "lab":
            totals = BatchTotals(ROWS, int(mask.sum()), LENGTH)
            loss = grpo_loss(lab_logprobs(h, w, targets, temperature), old, ref, advantages, mask, totals, settings)[0]
        else:
            fused = liger.LigerFusedLinearGRPOLoss(
                beta=beta,
                compiled=False,  # why: the CPU; the GPU side compiles the same chunk function
                use_ref_model=beta != 0,
                loss_type=loss_type,
                epsilon_low=0.2,
                epsilon_high=0.28,
                temperature=temperature,
                max_completion_length=LENGTH,
                importance_sampling_level=level,
            )
            loss = fused(h, w, targets, mask, advantages, ref_per_token_logps=ref, old_per_token_logps=old)[0]
        loss.backward()
        results[side] = (loss.detach(), h.grad, w.grad)
    assert results["lab"][0].abs() > 1e-3  # a loss that is not trivially zero
    for ours, theirs in zip(results["lab"], results["liger"]):
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
