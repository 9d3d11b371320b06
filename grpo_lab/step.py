"""One GRPO step, phase by phase. Each phase is a public function taking the typed output of
the one before; `step()` only composes them (via the Lab, which times and marks each phase):

    rollout -> rewards -> advantages -> log-probs -> loss and backward -> optimizer step -> sync

Departs from TRL: micro-batching the log-prob/backward passes never changes the objective
(losses normalise over the whole step batch), and a step is one optimizer update per
rollout iteration (`num_iterations`), with no gradient accumulation across rollouts.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional

import torch

from .errors import LabError, NonFinite
from .generation.base import GenerationRequest
from .logprobs import completion_logprobs, micro_batches, rollout_slice
from .losses import BatchTotals, grpo_loss
from .rewards import reward_name
from .types import Advantages, LogProbs, LossStats, Rewards, Rollout, StepResult


def rollout(generator, prompts, config) -> Rollout:
    """Sample `num_generations` completions for each of `prompts_per_step` prompts."""
    gen, grpo = config.generator, config.grpo
    batch = prompts.next_batch(grpo.prompts_per_step)
    request = GenerationRequest(gen.max_completion_length, gen.temperature, gen.top_p, gen.top_k)
    return generator.generate(batch, grpo.num_generations, request)


def score(rollout: Rollout, reward_funcs: list[Callable], weights: Optional[list[float]] = None) -> Rewards:
    """Call every reward function with TRL's signature and combine them (NaN = no opinion)."""
    n = len(rollout)
    columns = {"answer": rollout.repeated(rollout.batch.answers)}
    columns.update({k: rollout.repeated(v) for k, v in rollout.batch.extra.items()})
    lengths = rollout.completion_lengths.tolist()
    completion_ids = [ids[:k] for ids, k in zip(rollout.completion_ids.tolist(), lengths)]
    prompts = rollout.repeated(rollout.batch.prompts)
    table = torch.empty(n, len(reward_funcs))
    for j, fn in enumerate(reward_funcs):
        name = reward_name(fn)
        values = fn(prompts=prompts, completions=rollout.completions, completion_ids=completion_ids, **columns)
        if values is None or len(values) != n:
            raise LabError(f"reward {name!r} returned {0 if values is None else len(values)} values for {n} completions; "
                           "return one float (or None) per completion")
        table[:, j] = torch.tensor([math.nan if v is None else float(v) for v in values])
    w = torch.tensor(weights if weights is not None else [1.0] * len(reward_funcs))
    total = (table * w).nansum(dim=1)
    total[torch.isnan(table).all(dim=1)] = math.nan   # why: no reward had an opinion; kept out of the baseline
    return Rewards(per_function=table, names=[reward_name(f) for f in reward_funcs], total=total,
                   num_generations=rollout.num_generations)


def compute_advantages(rewards: Rewards, scale_rewards: str) -> Advantages:
    """Group-relative advantages: reward minus its group's mean, over the group's (or batch's) std.
    Groups are the rollout's own (`rewards.num_generations`), whatever the config says now."""
    from trl.trainer.utils import nanstd

    num_generations = rewards.num_generations
    grouped = rewards.total.view(-1, num_generations)                              # [B, G]
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)          # [N]
    group_std = nanstd(grouped, dim=1).repeat_interleave(num_generations)            # [N]
    std = nanstd(rewards.total).expand_as(rewards.total) if scale_rewards == "batch" else group_std
    values = rewards.total - mean
    if scale_rewards != "none":
        values = values / (std + 1e-4)
    values = torch.nan_to_num(values, nan=0.0)    # why: an unscored completion gets no push either way
    return Advantages(values=values, group_mean=mean, group_std=group_std)


def compute_logprobs(learner, reference, rollout: Rollout, config) -> LogProbs:
    """Old log-probs (only when a rollout is reused for several updates) and reference log-probs."""
    from .logprobs import rollout_logprobs

    micro = config.grpo.micro_batch_size
    old = None
    if config.grpo.num_iterations > 1:  # why: on-policy (one update) the old log-probs equal the current ones, detached
        learner.model.eval()
        old = rollout_logprobs(learner.model, rollout, learner.device, micro)
    ref = reference.logprobs(learner, rollout, micro) if config.grpo.beta > 0 else None
    return LogProbs(old=old, ref=ref)


def loss_mask(rollout: Rollout, mask_truncated: bool) -> torch.Tensor:
    """[N, L] completion tokens that count in the loss."""
    mask = rollout.completion_mask.float()
    if mask_truncated:
        mask = mask * (~rollout.truncated).float().unsqueeze(1)
    return mask


def loss_and_backward(learner, rollout: Rollout, advantages: Advantages, logprobs: LogProbs, config) -> LossStats:
    """Forward with gradients and backward, one micro-batch at a time; gradients accumulate in the LoRA params."""
    grpo, device = config.grpo, learner.device
    mask_all = loss_mask(rollout, grpo.mask_truncated_completions)
    totals = BatchTotals(len(rollout), int(mask_all.sum().item()), config.generator.max_completion_length)
    model = learner.model
    model.train()  # why: gradient checkpointing (if on) only recomputes activations in train mode
    learner.optimizer.zero_grad(set_to_none=True)
    loss_sum = kl_sum = clipped_sum = mismatch_sum = mismatch_kl_sum = 0.0
    for rows in micro_batches(len(rollout), grpo.micro_batch_size):
        prompt_ids, prompt_mask, completion_ids, completion_mask = rollout_slice(rollout, rows, device)
        mask = mask_all[rows].to(device)
        logps = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask).float()
        take = lambda t: None if t is None else t[rows].to(device)  # noqa: E731
        sampler = rollout.sampler_logprobs[rows].to(device)
        old = take(logprobs.old)
        gap = (logps.detach() if old is None else old) - sampler            # log(learner / sampler) per token
        weights = torch.exp(gap).clamp(max=grpo.importance_sampling_cap) if grpo.importance_sampling_correction else None
        loss, kl, clipped = grpo_loss(
            logps, old, take(logprobs.ref), advantages.values[rows].to(device), mask, totals,
            grpo.loss_type, grpo.beta, grpo.epsilon, config.epsilon_high, sampling_weights=weights)
        value = loss.item()
        if not math.isfinite(value):
            learner.optimizer.zero_grad(set_to_none=True)  # why: earlier micro-batches' gradients belong to a refused step
            raise NonFinite("backward", f"loss is {value}", "check the rewards and advantages for inf/nan, "
                            "or lower grpo.learning_rate / grpo.beta")
        loss.backward()
        loss_sum += value
        mismatch_sum += (gap.abs() * mask).sum().item()
        mismatch_kl_sum += ((torch.exp(gap) - gap - 1) * mask).sum().item()
        clipped_sum += (clipped.float() * mask).sum().item()
        if kl is not None:
            kl_sum += (kl.detach() * mask).sum().item()
        del logps, loss, kl  # why: free this micro-batch's activations before the next forward
    tokens = max(totals.num_tokens, 1)
    return LossStats(loss=loss_sum, kl=kl_sum / tokens if grpo.beta > 0 else None,
                     clip_fraction=clipped_sum / tokens, logprob_mismatch=mismatch_sum / tokens,
                     logprob_kl=mismatch_kl_sum / tokens,
                     num_tokens=totals.num_tokens)


def optimizer_step(learner, max_grad_norm: float) -> float:
    """Clip, update the LoRA parameters, drop the gradients; returns the pre-clip gradient norm.
    A non-finite gradient norm is refused before the update, non-finite weights after it (the Lab
    rolls the update back): NaN never reaches AdamW's moments or the adapter."""
    params = [p for p in learner.model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    if not math.isfinite(grad_norm):
        learner.optimizer.zero_grad(set_to_none=True)  # why: these gradients must never be applied
        raise NonFinite("optimizer", f"gradient norm is {grad_norm}", "lower grpo.learning_rate or check the "
                        "rewards and advantages for inf/nan")
    learner.optimizer.step()
    learner.optimizer.zero_grad(set_to_none=True)  # why: gradients are not needed until the next backward
    bad = int(torch.stack([~torch.isfinite(p).all() for p in params]).sum().item())   # one sync for all LoRA tensors
    if bad:
        raise NonFinite("optimizer", f"the update made {bad} of {len(params)} LoRA weights non-finite",
                        "lower grpo.learning_rate (or grpo.max_grad_norm)")
    return grad_norm


def sync_generator(generator, learner) -> None:
    """Push the updated LoRA weights to the generator (a no-op when it samples with the learner itself)."""
    generator.sync(learner)


def step(lab) -> StepResult:
    """One GRPO step: the phases above, in order, each timed and marked by the Lab."""
    started = time.perf_counter()
    rollout_ = lab.rollout()
    rewards = lab.rewards(rollout_)
    advantages = lab.advantages(rewards)
    logprobs = lab.logprobs(rollout_)
    for _ in range(lab.config.grpo.num_iterations):
        stats = lab.loss_and_backward(rollout_, advantages, logprobs)
        grad_norm = lab.optimizer_step()
    lab.sync()
    return summarize(lab.step_index, rollout_, rewards, advantages, stats, grad_norm,
                     lab.timeline.seconds(lab.step_index), time.perf_counter() - started)


def summarize(step_index, rollout_: Rollout, rewards: Rewards, advantages: Advantages, stats: LossStats,
              grad_norm: float, phase_seconds: dict, seconds: float) -> StepResult:
    total = rewards.total
    lengths = rollout_.completion_lengths.float()
    means = torch.nanmean(rewards.per_function, dim=0).tolist()
    return StepResult(
        step=step_index,
        reward_mean=torch.nanmean(total).item(),
        reward_std=total[~torch.isnan(total)].std().item() if (~torch.isnan(total)).sum() > 1 else 0.0,
        rewards=dict(zip(rewards.names, means)),
        advantage_std=advantages.values.std().item(),
        loss=stats.loss, kl=stats.kl, clip_fraction=stats.clip_fraction,
        logprob_mismatch=stats.logprob_mismatch, logprob_kl=stats.logprob_kl, grad_norm=grad_norm,
        completion_length_mean=lengths.mean().item(),
        completion_length_min=int(lengths.min().item()), completion_length_max=int(lengths.max().item()),
        truncated_fraction=rollout_.truncated.float().mean().item(),
        phase_seconds=phase_seconds, step_seconds=seconds, sync_seconds=phase_seconds.get("sync", 0.0),
    )
