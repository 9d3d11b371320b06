"""The step's phases on the real 4-bit tiny model: weights, chunking invariance, determinism, references."""

import math

import pytest
import torch

from grpo_lab import Lab
from grpo_lab.generation.base import GenerationRequest, chunked


def lora_state(lab):
    return {n: p.detach().clone() for n, p in lab.learner.model.named_parameters() if "lora_" in n}


def base_state(lab):
    """Every non-LoRA tensor, including the packed nf4 weights and their quantization constants."""
    out = {n: t.detach().clone() for n, t in lab.learner.model.state_dict().items() if "lora_" not in n}
    assert any(t.dtype == torch.uint8 for t in out.values()), "expected packed 4-bit weights"
    return out


def test_lora_parameters_are_the_only_trainable_ones(loaded_lab):
    lab = loaded_lab()
    trainable = [n for n, p in lab.learner.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    import bitsandbytes as bnb

    assert any(isinstance(m, bnb.nn.Linear4bit) for m in lab.learner.model.modules())


def test_step_changes_lora_and_leaves_4bit_base_bit_identical(loaded_lab):
    lab = loaded_lab(grpo={"beta": 0.04})
    lora_before, base_before = lora_state(lab), base_state(lab)
    result = lab.step()
    assert result.grad_norm > 0, "the tiny model's length reward should give a gradient"
    lora_after, base_after = lora_state(lab), base_state(lab)
    assert any(not torch.equal(lora_before[n], lora_after[n]) for n in lora_before)
    for name, tensor in base_before.items():
        assert torch.equal(tensor, base_after[name]), name


def test_step_result_has_metrics_and_phase_times(loaded_lab):
    lab = loaded_lab(grpo={"beta": 0.04})
    metrics = lab.step().metrics()
    for key in (
        "step",
        "reward_mean",
        "loss",
        "kl",
        "grad_norm",
        "clip_fraction",
        "completion_length_mean",
        "seconds/rollout",
        "seconds/rewards",
        "seconds/advantages",
        "seconds/logprobs",
        "seconds/backward",
        "seconds/optimizer",
        "seconds/sync",
    ):
        assert key in metrics, key
    assert metrics["kl"] is not None and lab.history[0].step == 0 and lab.step_index == 1


def test_phases_can_be_called_one_by_one(loaded_lab):
    lab = loaded_lab(grpo={"beta": 0.04})
    rollout = lab.rollout()
    n = 2 * 4
    assert rollout.completion_ids.shape[0] == n and len(rollout.completions) == n
    assert rollout.sampler_logprobs.shape == rollout.completion_ids.shape
    rewards = lab.rewards(rollout)
    assert rewards.per_function.shape == (n, 3) and rewards.names == ["exact_answer", "format", "length"]
    adv = lab.advantages(rewards)
    groups = adv.values.view(2, 4)
    assert torch.allclose(groups.sum(1), torch.zeros(2), atol=1e-4)  # zero-mean within each group
    lp = lab.logprobs(rollout)
    assert lab.current.old_logprobs is None and lp.ref.shape == rollout.completion_ids.shape
    stats = lab.backward(rollout, adv, lp)
    assert math.isfinite(stats.loss) and stats.num_tokens == int(rollout.completion_mask.sum())
    params = lab.learner.trainable_parameters()
    grads = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
    assert grads, "backward left no gradients"
    by_hand = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads.values()))
    before = lora_state(lab)
    grad_norm = lab.optimizer()
    assert by_hand > 0 and grad_norm == pytest.approx(by_hand, rel=1e-5)
    after = lora_state(lab)
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and moved <= set(grads)
    for n in before:  # AdamW's first update is 0 where the gradient is 0
        if n in grads and not grads[n].any():
            assert n not in moved, n
    assert all(p.grad is None for p in params.values())
    lab.sync()
    assert set(lab.timeline.seconds(0)) == {
        "rollout",
        "rewards",
        "advantages",
        "logprobs",
        "backward",
        "optimizer",
        "sync",
    }


@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_chunked_generation_equals_unchunked_greedy(loaded_lab, chunk_size):
    lab = loaded_lab(generator={"temperature": 0})
    batch = lab.prompts.next_batch(3)
    whole = lab.generator.generate(batch, 2, GenerationRequest(max_completion_length=12, temperature=0))
    parts = lab.generator.generate(
        batch, 2, GenerationRequest(max_completion_length=12, temperature=0, chunk_size=chunk_size)
    )
    assert torch.equal(whole.completion_ids, parts.completion_ids)
    assert torch.equal(whole.completion_mask, parts.completion_mask)
    assert torch.allclose(whole.sampler_logprobs, parts.sampler_logprobs, atol=1e-5)


def test_chunked_splits_with_a_partial_last_chunk():
    assert [list(c) for c in chunked(list(range(7)), 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [list(c) for c in chunked(list(range(7)), None)] == [list(range(7))]


def test_micro_batched_logprobs_and_gradients_equal_the_whole_batch(loaded_lab):
    lab = loaded_lab(grpo={"beta": 0.04, "micro_batch_size": None})
    rollout = lab.rollout()
    rewards = lab.rewards(rollout)
    adv = lab.advantages(rewards)
    whole_lp = lab.logprobs(rollout)
    whole = lab.backward(rollout, adv, whole_lp)
    whole_grads = {n: p.grad.clone() for n, p in lab.learner.model.named_parameters() if p.grad is not None}
    lab.rollback()  # drop those gradients; the step goes on from its logprobs
    lab.config.grpo.micro_batch_size = 3  # does not divide 8; live: the next phases read it
    part_lp = lab.logprobs(rollout)
    part = lab.backward(rollout, adv, part_lp)
    mask = rollout.completion_mask.bool()
    assert torch.allclose(whole_lp.ref[mask], part_lp.ref[mask], atol=1e-5)
    assert whole.loss == pytest.approx(part.loss, abs=1e-5)
    assert whole.kl == pytest.approx(part.kl, abs=1e-6)
    for n, p in lab.learner.model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(whole_grads[n], p.grad, atol=1e-5, rtol=1e-4), n


def test_learner_logprobs_match_the_sampler(loaded_lab):
    """Same weights, same positions: the learner scores the tokens as generate() sampled them."""
    lab = loaded_lab(generator={"temperature": 0.7})
    rollout = lab.rollout()
    from grpo_lab.algo.logprobs import rollout_logprobs

    learner = rollout_logprobs(lab.learner.model.eval(), rollout, lab.learner.device, None)
    mask = rollout.completion_mask.bool()
    assert torch.allclose(learner[mask], rollout.sampler_logprobs[mask], atol=1e-3)


def test_same_seed_same_metrics(tiny_config):
    def run():
        lab = Lab(tiny_config(grpo={"beta": 0.04})).load()
        timing_and_memory = ("step_seconds", "sync_seconds", "memory", "leaks")
        return [
            {
                k: v
                for k, v in lab.step().metrics().items()
                if not k.startswith("seconds") and k not in timing_and_memory
            }
            for _ in range(2)
        ]

    assert run() == run()


def test_reference_copy_equals_adapter_disabled_before_training(tiny_config):
    """With LoRA B zero-initialised the policy is the base: both references give the base's log-probs."""
    disabled = Lab(tiny_config(grpo={"beta": 0.1})).load()
    copy = Lab(tiny_config(grpo={"beta": 0.1}, reference={"strategy": "copy", "device": "cpu"})).load()
    rollout = disabled.rollout()
    a = disabled.logprobs(rollout).ref
    # another Lab's rollout: through the reference itself
    b = copy.reference.logprobs(copy.learner, rollout, copy.config)
    mask = rollout.completion_mask.bool()
    assert torch.allclose(a[mask], b[mask], atol=1e-5)
    assert copy.reference.model is not copy.learner.model


def test_reference_none_gives_no_kl(loaded_lab):
    lab = loaded_lab(grpo={"beta": 0.0})
    result = lab.step()
    assert lab.config.reference_strategy == "none" and result.kl is None


@pytest.mark.parametrize("lora_dropout", [0.0, 0.5])
def test_num_iterations_old_logprobs_are_the_first_iterations_own(loaded_lab, monkeypatch, lora_dropout):
    """Two updates per rollout: the first with ratio exactly 1 (old = its own forward, detached), with or
    without LoRA dropout; the second against the same old log-probs, and it can clip."""
    import grpo_lab.algo.grpo as step_module

    lab = loaded_lab(
        lora={"lora_dropout": lora_dropout}, grpo={"num_iterations": 2, "learning_rate": 5e-2, "epsilon": 0.01}
    )
    rollout = lab.rollout()
    lab.logprobs(rollout)
    assert lab.current.old_logprobs is None  # no pass of its own: the first backward records it

    passes, stats, weights = [], [], [lora_state(lab)]
    real_loss = step_module.grpo_loss

    def recording_loss(logps, old, ref, advantages, mask, *args, **kwargs):
        passes.append((logps.detach().clone(), old.clone(), mask.bool().clone()))
        return real_loss(logps, old, ref, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(step_module, "grpo_loss", recording_loss)
    real_backward, real_update = lab.backward, lab.optimizer
    monkeypatch.setattr(lab, "backward", lambda *a: stats.append(real_backward(*a)) or stats[-1])
    monkeypatch.setattr(lab, "optimizer", lambda: (real_update(), weights.append(lora_state(lab)))[0])
    result = lab.step()

    assert len(stats) == 2 and len(weights) == 3 and len(passes) == 2  # whole batch: one micro-batch per pass
    assert result.iterations == 2
    for a, b in zip(weights, weights[1:]):  # each of the two updates moved the LoRA weights
        assert any(not torch.equal(a[n], b[n]) for n in a)
    assert {int(s["step"]) for s in lab.learner.optimizer.state.values()} == {2}

    (logps1, old1, mask), (logps2, old2, _) = passes
    assert torch.equal(old1, old2)  # both passes against the same old policy
    assert torch.equal(logps1[mask], old1[mask])  # first pass: ratio exactly 1, dropout or not...
    assert torch.equal(torch.exp(logps1 - old1)[mask], torch.ones(int(mask.sum())))
    assert stats[0].clip_fraction == 0.0  # ...so nothing can be clipped (epsilon is 0.01)
    assert not torch.equal(logps2[mask], old2[mask])  # second pass: the policy moved
    assert stats[1].clip_fraction > 0.0 and result.clip_fraction == stats[1].clip_fraction
    assert math.isfinite(result.loss)


def test_advantages_group_by_the_rollouts_group_size_not_the_config(loaded_lab):
    """An edit of grpo.num_generations between rollout and advantages must not regroup that rollout."""
    lab = loaded_lab()  # G = 4, 2 prompts
    rollout = lab.rollout()
    rewards = lab.rewards(rollout)
    expected = lab.advantages(rewards).values.clone()
    assert rewards.total.view(2, 4).std(dim=1).gt(0).any()  # groups with variance: a regrouping would show
    lab.config.grpo.num_generations = 2  # takes effect at the next rollout
    assert torch.equal(lab.advantages(rewards).values, expected)
    assert len(lab.rollout()) == 2 * 2


def test_a_missing_sampler_logprob_stays_out_of_the_mismatch_metrics(loaded_lab):
    """vLLM can return no log-prob for a token (NaN in the rollout): the metrics skip it, as TRL's do."""
    lab = loaded_lab()
    rollout = lab.rollout()
    advantages = lab.advantages(lab.rewards(rollout))
    logprobs = lab.logprobs(rollout)
    clean = lab.backward(rollout, advantages, logprobs)
    lab.rollback()
    rollout.sampler_logprobs[0, 0] = math.nan
    holed = lab.backward(rollout, advantages, logprobs)
    assert math.isfinite(holed.logprob_mismatch) and math.isfinite(holed.logprob_kl)
    assert holed.logprob_mismatch == pytest.approx(clean.logprob_mismatch, rel=0.5, abs=1e-4)
