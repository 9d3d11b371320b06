"""Parity with TRL 1.16's GRPOTrainer, driving TRL's own code (not a copy of it).

TRL gets our completions through its public `rollout_func` hook and our reward functions; its
`_generate_and_score_completions` computes the advantages and its `_compute_loss` the loss, on the
same PEFT model, with our old/reference log-probs fed in. Both must match grpo_lab's within 1e-5.
"""
import math

import pytest
import torch

from grpo_lab import Lab


def trl_trainer(lab, rollout, tmp_path, sampler_logprobs=None, **overrides):
    """A GRPOTrainer on the lab's model whose `rollout_func` returns `rollout`'s completions and its sampler
    log-probs (or `sampler_logprobs` [N, L]; NaN goes to TRL as None, as vLLM sends it); `overrides` are
    GRPOConfig fields. Returns the trainer and the inputs for its `_generate_and_score_completions`."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    cfg = lab.config
    n = len(rollout)
    lengths = rollout.completion_lengths.tolist()
    prompt_rows = [ids[m.bool()].tolist() for ids, m in zip(rollout.prompt_ids, rollout.prompt_mask)]
    completion_rows = [ids[:k] for ids, k in zip(rollout.completion_ids.tolist(), lengths)]
    sampler = rollout.sampler_logprobs if sampler_logprobs is None else sampler_logprobs
    sampler_rows = [[None if math.isnan(x) else x for x in lp[:k]] for lp, k in zip(sampler.tolist(), lengths)]

    def rollout_func(prompts, trainer):
        assert len(prompts) == n
        return {"prompt_ids": prompt_rows, "completion_ids": completion_rows, "logprobs": sampler_rows}

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[], save_strategy="no",
        bf16=False,  # TRL's default runs its forward under bf16 autocast; both sides compute in float32 here
        per_device_train_batch_size=n, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=cfg.grpo.num_generations, max_completion_length=cfg.generator.max_completion_length,
        temperature=cfg.generator.temperature, beta=cfg.grpo.beta, loss_type=cfg.grpo.loss_type,
        scale_rewards=cfg.grpo.scale_rewards, epsilon=cfg.grpo.epsilon, epsilon_high=cfg.epsilon_high,
        num_iterations=cfg.grpo.num_iterations, mask_truncated_completions=cfg.grpo.mask_truncated_completions,
        gradient_checkpointing=False, reward_weights=cfg.data.reward_weights, **overrides,
    )
    dataset = Dataset.from_list([{"prompt": p, "answer": a} for p, a in zip(rollout.batch.prompts, rollout.batch.answers)])
    trainer = GRPOTrainer(model=lab.learner.model, reward_funcs=lab.reward_funcs, args=args, train_dataset=dataset,
                          processing_class=lab.learner.tokenizer, rollout_func=rollout_func)
    trainer.current_gradient_accumulation_steps = 1
    inputs = [{"prompt": p, "answer": a} for p, a in zip(rollout.repeated(rollout.batch.prompts),
                                                          rollout.repeated(rollout.batch.answers))]
    return trainer, inputs


def vllm_importance_sampling(trainer, mode, clip_min, clip_max):
    """Send the trainer down its vLLM importance-sampling path (`use_vllm` is set after construction, so no
    vLLM engine is built; the completions still come from `rollout_func`, which TRL then treats as vLLM's)."""
    trainer.use_vllm = True
    trainer._last_loaded_step = trainer.state.global_step   # why: nothing to sync, there is no vLLM engine
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min = clip_min
    trainer.vllm_importance_sampling_clip_max = clip_max


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_and_loss_match_trl(tiny_config, tmp_path, loss_type, scale_rewards):
    lab = Lab(tiny_config(
        grpo={"beta": 0.04, "loss_type": loss_type, "scale_rewards": scale_rewards, "micro_batch_size": 3},
        generator={"temperature": 0.8},
        data={"rewards": ["exact_answer", "format", "length"], "reward_weights": [1.0, 0.5, 2.0]},
    )).load()
    # one update first, so the policy differs from the reference and the KL term is non-zero
    lab.step()
    rollout = lab.rollout()
    rewards = lab.rewards(rollout)
    assert rewards.total.std() > 0, "parity needs rewards that differ"
    advantages = lab.advantages(rewards)
    logprobs = lab.logprobs(rollout)

    # TRL's constructor changes the model it is given (4-bit: LoRA weights cast to bf16; beta > 0: a "ref"
    # adapter added), so it is built first and both losses are computed on the model as TRL left it.
    trainer, inputs = trl_trainer(lab, rollout, tmp_path)
    ours = lab.loss_and_backward(rollout, advantages, logprobs)
    assert ours.kl > 0
    batch = trainer._generate_and_score_completions(inputs)
    assert torch.equal(batch["completion_ids"].cpu(), rollout.completion_ids)
    assert torch.allclose(batch["advantages"].cpu(), advantages.values, atol=1e-5)

    batch["ref_per_token_logps"] = logprobs.ref          # identical reference log-probs on both sides
    batch.pop("old_per_token_logps", None)               # on-policy on both sides
    lab.learner.model.train()
    with torch.no_grad():
        theirs = trainer._compute_loss(lab.learner.model, batch).item()
    assert ours.loss == pytest.approx(theirs, abs=1e-5)
