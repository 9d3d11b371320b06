"""importance_weights equals the importance-sampling ratio TRL 1.16 computes itself.

TRL's `_generate_and_score_completions` is sent down its vLLM branch (see test_trl_parity's
`vllm_importance_sampling`) on our completions, with sampler log-probs that differ from the learner's
by seeded noise: ratios land below, inside and above the bounds, and a few sampler log-probs are
missing (NaN; vLLM sends None). TRL's old log-probs are its own forward; ours are grpo_lab's.
"""

from types import SimpleNamespace

import pytest
import torch
from test_trl_parity import noisy_sampler, trl_trainer, vllm_importance_sampling

from grpo_lab import Lab
from grpo_lab.algo.importance import MODES, importance_weights
from grpo_lab.algo.logprobs import rollout_logprobs

pytestmark = pytest.mark.xdist_group("importance")  # why: its tests share module-scoped state: one worker builds it

BOUNDS = [(None, 3.0), (0.5, 3.0), (0.5, None), (None, None)]
# mode, clip_min, clip_max, mask_truncated_completions. TRL (and grpo_lab's config) refuse a *_truncate mode
# with no bound at all; the truncation mask changes only which tokens count, so once per mode is enough.
CASES = [
    (mode, lo, hi, False) for mode in MODES for lo, hi in BOUNDS if mode.endswith("_mask") or (lo, hi) != (None, None)
] + [(mode, 0.5, 3.0, True) for mode in MODES]
NAN_AT = [(0, 0), (3, 1)]  # (row, token) where the sampler has no log-prob


@pytest.fixture
def sampled(shared, tiny_config, tmp_path_factory):
    """One lab, rollout, noisy sampler and TRL trainer for the module (built on first use)."""
    if not shared:
        # max_completion_length 16: some completions end, most are truncated (asserted where it matters)
        lab = Lab(tiny_config(grpo={"prompts_per_step": 8, "beta": 0.0})).load()  # 32 rows: several end, several not
        rollout = lab.rollout()
        learner = rollout_logprobs(lab.learner.model.train(), rollout, lab.learner.device, None)
        shared.update(lab=lab, rollout=rollout, learner=learner, sampler=noisy_sampler(rollout, nan_at=NAN_AT))
        shared["trainer"], shared["inputs"] = trl_trainer(
            lab, rollout, tmp_path_factory.mktemp("trl"), sampler_logprobs=shared["sampler"]
        )
    return SimpleNamespace(**shared)


def raw_ratios(learner, sampler, mask, per_sequence):
    """exp(learner - sampler) before any bound, per token or per sequence; NaN -> no correction."""
    diff = torch.nan_to_num((learner - sampler) * mask, nan=0.0)
    return torch.exp(diff.sum(-1, keepdim=True) if per_sequence else diff)


@pytest.mark.parametrize("mode, clip_min, clip_max, mask_truncated", CASES)
def test_importance_weights_match_trl(sampled, mode, clip_min, clip_max, mask_truncated):
    rollout, trainer = sampled.rollout, sampled.trainer
    vllm_importance_sampling(trainer, mode, clip_min, clip_max)
    trainer.mask_truncated_completions = mask_truncated
    batch = trainer._generate_and_score_completions(sampled.inputs)
    theirs = batch["importance_sampling_ratio"].cpu()

    mask = rollout.completion_mask.float()
    if mask_truncated:  # TRL takes the ratio over the loss mask: a truncated completion gets none (ratio 1)
        assert rollout.truncated.any() and (~rollout.truncated).any()
        mask = mask * (~rollout.truncated).float().unsqueeze(1)
    assert torch.equal(batch["completion_ids"].cpu(), rollout.completion_ids)
    assert torch.equal(batch["completion_mask"].cpu().float(), mask)
    ours = importance_weights(sampled.learner, sampled.sampler, mask, mode, clip_min, clip_max)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    # the case is only a test if the ratios cross the bounds it sets, and some stay inside
    per_sequence = MODES[mode][0]
    raw = raw_ratios(sampled.learner, sampled.sampler, mask, per_sequence)
    raw = raw.flatten() if per_sequence else raw[mask.bool()]
    lo, hi = clip_min if clip_min is not None else 0.5, clip_max if clip_max is not None else 3.0
    assert (raw < lo).any() and (raw > hi).any() and ((raw >= lo) & (raw <= hi)).any()
    assert not torch.allclose(ours, torch.ones_like(ours))
    if mode.endswith("_mask") and (clip_min, clip_max) != (None, None):
        assert (ours == 0).any()


@pytest.mark.parametrize("mode", MODES)
def test_nan_sampler_logprob_is_no_correction(sampled, mode):
    """A token the sampler could not score counts as if the sampler agreed with the learner there."""
    mask = sampled.rollout.completion_mask.float()
    agreed = sampled.sampler.clone()
    for row, token in NAN_AT:
        agreed[row, token] = sampled.learner[row, token]
    ours = importance_weights(sampled.learner, sampled.sampler, mask, mode, 0.5, 3.0)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, importance_weights(sampled.learner, agreed, mask, mode, 0.5, 3.0))
