"""One GRPO step, phase by phase. `step()` is the algorithm; each phase (phases.PHASES) is a public function of the
same name taking the typed output of the one before, and returning a new value (it changes no input). The Lab
checks, times and marks each phase, and undoes a step that fails part-way.

Departs from TRL: micro-batching the log-prob/backward passes never changes the objective
(losses normalise over the whole step batch); a step is one optimizer update per rollout
iteration (`num_iterations`), with no gradient accumulation across rollouts; and old log-probs
are the first iteration's own forward, detached (no extra pass; see `backward`).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from ..errors import LabError, NonFinite
from ..recovery.faults import poison
from ..runtime import runtime
from .containers import Advantages, BackwardResult, GenerationRequest, LogProbs, LossStats, Rewards, Rollout, StepResult
from .importance import importance_weights
from .logprobs import completion_logprobs, configure_head, micro_batches, rollout_slice
from .loss_metrics import LossSums, learner_sampler_gap
from .losses import BatchTotals, LossSettings, grpo_loss
from .reward_calls import RewardLog, RewardState, call_rewards
from .rewards import reward_name


def step(phases, num_iterations: int) -> StepResult:
    """One GRPO step (DeepSeekMath's Algorithm 1, one batch): sample a group of completions per prompt, score them,
    turn the scores into group-relative advantages, then take `num_iterations` clipped-surrogate updates on that one
    rollout, and hand the new weights to the generator. `phases` runs each phase: the Lab's phase methods, which check,
    time and roll back (where a step is resumed, a phase it already ran gives back what it produced)."""
    rollout = phases.rollout()
    rewards = phases.rewards(rollout)
    advantages = phases.advantages(rewards)
    logprobs = phases.logprobs(rollout)
    for _ in range(num_iterations):  # mu in the paper: updates per rollout, each from the same old log-probs
        phases.backward(rollout, advantages, logprobs)
        phases.optimizer()
    return phases.sync()


def rollout(
    generator, prompts, config, decode: Optional[str] = None, copy: str = "release", park_bytes: int = 0
) -> Rollout:
    """Sample `num_generations` completions for each of `prompts_per_step` prompts (an hf rollout decoding as `decode`
    says, its merged copy kept or released as `copy` says, a parked learner in a host buffer of `park_bytes`: the
    executor's resolutions of generator.hf_decode, generator.rollout_copy and the plan's parking buffer)."""
    grpo = config.grpo
    batch = prompts.next_batch(grpo.prompts_per_step)
    # (the worst-case probe's prompts ask for full-length completions: planner/worst_case.py)
    full = getattr(prompts, "full_length", False)
    request = GenerationRequest.from_config(config, full_length=full, decode=decode, copy=copy)
    request.park_buffer_bytes = park_bytes
    return generator.generate(batch, grpo.num_generations, request)


def rewards(
    rollout: Rollout,
    reward_funcs: list[Callable],
    weights: Optional[list[float]] = None,
    state: Optional[RewardState] = None,
) -> Rewards:
    """Call every reward function as TRL 1.16 calls it and combine them (NaN = no opinion). A conversational batch's
    prompts are chat messages and its completions `[{"role": "assistant", "content": ...}]`; every other dataset
    column, `completion_ids`, `trainer_state`, `log_extra` and `log_metric` arrive as keywords; async functions run
    concurrently (reward_calls.py)."""
    n, batch = len(rollout), rollout.batch
    log = RewardLog()
    lengths = rollout.completion_lengths.tolist()
    kwargs = {
        "prompts": rollout.row_prompts or rollout.repeated(batch.raw if batch.raw is not None else batch.prompts),
        "completions": (
            rollout.conversations  # a tool-calling rollout's: its assistant and tool messages, as TRL's
            or (
                [[{"role": "assistant", "content": c}] for c in rollout.completions]
                if batch.conversational
                else rollout.completions
            )
        ),
        "completion_ids": [ids[:k] for ids, k in zip(rollout.completion_ids.tolist(), lengths)],
        "answer": rollout.repeated(batch.answers),
        **{k: rollout.repeated(v) for k, v in batch.extra.items()},  # the dataset's own 'answer' as it has it
        "trainer_state": state or RewardState(global_step=rollout.step),
        "log_extra": log.log_extra,
        "log_metric": log.log_metric,
        **({"environments": rollout.environments} if rollout.environments is not None else {}),  # TRL's
    }
    names = [reward_name(f) for f in reward_funcs]
    values = call_rewards(list(zip(names, reward_funcs)), n, kwargs)
    table = torch.tensor(values, dtype=torch.float32).T.reshape(n, len(reward_funcs))  # [N, F]
    w = torch.tensor(weights if weights is not None else [1.0] * len(reward_funcs))
    total = (table * w).nansum(dim=1)
    total[torch.isnan(table).all(dim=1)] = math.nan  # why: no reward had an opinion; kept out of the baseline
    return Rewards(
        per_function=table,
        names=names,
        total=total,
        num_generations=rollout.num_generations,
        logged=log.means(),
        logged_columns=dict(log.columns),
    )


def advantages(rewards: Rewards, scale_rewards: str) -> Advantages:
    """Group-relative advantages: reward minus its group's mean, over the group's (or batch's) std.
    Groups are the rollout's own (`rewards.num_generations`), whatever the config says now."""
    num_generations = rewards.num_generations
    grouped = rewards.total.view(-1, num_generations)  # [B, G]
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)  # [N]
    group_std = nanstd(grouped, dim=1).repeat_interleave(num_generations)  # [N]
    std = nanstd(rewards.total).expand_as(rewards.total) if scale_rewards == "batch" else group_std
    values = rewards.total - mean
    if scale_rewards != "none":
        values = values / (std + 1e-4)
    values = torch.nan_to_num(values, nan=0.0)  # why: an unscored completion gets no push either way
    return Advantages(values=values, group_mean=mean, group_std=group_std)


def nanstd(values: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """The sample standard deviation ignoring NaNs (NaN where fewer than two values are left), as TRL's
    `trl.trainer.utils.nanstd` computes it (tests/test_trl_parity.py compares them). Why not import TRL's: that module
    imports transformers' Trainer: 90 MiB of host RSS and 0.74 s in every process that steps
    (bench/probes/process_baseline.py)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(values), dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = variance.sqrt()
    return std.squeeze() if dim is None else std.squeeze(dim)


def logprobs(learner, reference, rollout: Rollout, config) -> LogProbs:
    """Reference log-probs, when the KL term is on (beta > 0). Old log-probs are not a pass of their own:
    the rollout's first backward records them (see `backward`)."""
    ref = reference.logprobs(learner, rollout, config) if config.grpo.beta > 0 else None
    return LogProbs(ref=ref)


def applies_importance_sampling(config) -> bool:
    """IS corrects for a sampler that is not the learner: only a backend with its own weights can be one."""
    return config.grpo.importance_sampling_correction and config.generator.own_weights


def loss_mask(rollout: Rollout, mask_truncated: bool) -> torch.Tensor:
    """[N, L] completion tokens that count in the loss: the model's own (a tool result's tokens condition the later
    turns but are not the policy's actions: TRL's completion_mask * tool_mask), so the loss, the KL term, importance
    sampling and the sampler/learner gap all cover generated tokens only."""
    mask = rollout.completion_mask.float()
    if rollout.tool_mask is not None:
        mask = mask * rollout.tool_mask.float()
    if mask_truncated:
        mask = mask * (~rollout.truncated).float().unsqueeze(1)
    return mask


def backward(
    learner,
    rollout: Rollout,
    advantages: Advantages,
    logprobs: LogProbs,
    config,
    old_logprobs: Optional[torch.Tensor] = None,
) -> BackwardResult:
    """Forward with gradients and backward, one micro-batch at a time; gradients accumulate in the LoRA params.

    The rollout's first backward (no `old_logprobs` yet) is at the weights that sampled it: its own detached
    log-probs are the old log-probs (ratio exactly 1, dropout included, as the forward is the same) and the
    importance-sampling weights come from them; it returns them, for the rollout's later iterations."""
    grpo, device = config.grpo, learner.device
    require_reference(grpo.beta, logprobs)
    first, is_on = old_logprobs is None, applies_importance_sampling(config)
    settings = LossSettings.from_config(config)
    mask_all = loss_mask(rollout, grpo.mask_truncated_completions)
    totals = BatchTotals(len(rollout), int(mask_all.sum().item()), rollout.max_completion_length)
    model = learner.model
    # why train mode for every learner pass (this one, the reference's, the first iteration's old log-probs):
    # modes differ in LoRA dropout and gradient checkpointing, and one mode makes the first ratio exactly 1
    model.train()
    configure_head(model, config, rollout.logprob_temperature)
    learner.optimizer.zero_grad(set_to_none=True)
    olds, weights_all, sums = [], [], LossSums()
    ranks = runtime()  # a sharded learner's rank takes its rows; the totals above are the whole batch's
    for rows in micro_batches(len(rollout), grpo.micro_batch_size, ranks.rows(len(rollout))):
        prompt_ids, prompt_mask, completion_ids, completion_mask = rollout_slice(rollout, rows, device)
        mask = mask_all[rows].to(device)
        # a rank whose forward fails takes every rank out before any backward's reduce-scatter
        with learner.sharding.agreed(model):
            logps = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask).float()
        old = logps.detach() if first else old_logprobs[rows].to(device)
        sampler = rollout.sampler_logprobs[rows].to(device)
        gap, seen = learner_sampler_gap(old, sampler, mask)
        # from the old log-probs, so every iteration of the rollout gets the same weights
        weights = sampling_weights(old, sampler, mask, grpo) if is_on else None
        ref = None if logprobs.ref is None else logprobs.ref[rows].to(device)
        loss, kl, clipped = grpo_loss(
            logps, old, ref, advantages.values[rows].to(device), mask, totals, settings, sampling_weights=weights
        )
        loss = poison(loss)  # lab.arm_fault(..., "backward", "nan")
        value = loss.item()
        refuse_non_finite(value, learner, ranks)  # before this rank's backward starts a reduce-scatter
        loss.backward()
        sums.add(value, kl, clipped, mask, gap, seen)
        if first:  # why on the CPU: [N, L] floats kept for the rollout's later iterations, beside the rollout
            olds.append(old.cpu())
        if is_on:
            weights_all.append(weights.cpu())
        del logps, loss, kl  # why: free this micro-batch's activations before the next forward
    if first:  # why after the loop: a backward that failed part-way records nothing
        old_logprobs = ranks.gather_rows(torch.cat(olds))
    is_weights = ranks.gather_rows(torch.cat(weights_all)) if is_on else None
    return BackwardResult(sums.stats(ranks, totals, grpo.beta, is_weights, mask_all), old_logprobs, is_weights)


def sampling_weights(old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, grpo) -> torch.Tensor:
    """Importance-sampling weights [N, L] (or [N, 1]) for a sampler that is not the learner, over the loss mask as
    TRL (mask_truncated_completions zeroes its completion mask first)."""
    return importance_weights(
        old,
        sampler,
        mask,
        grpo.importance_sampling_mode,
        grpo.importance_sampling_clip_min,
        grpo.importance_sampling_clip_max,
    )


def require_reference(beta: float, logprobs: LogProbs) -> None:
    """A KL term needs this step's reference log-probs: refused when the logprobs phase ran at beta 0."""
    if beta > 0 and logprobs.ref is None:
        raise LabError(
            f"backward: grpo.beta is {beta} but this step's logprobs phase ran at beta 0, so there are "
            "no reference log-probs; run lab.logprobs(rollout) again (before the step's first update)"
        )


def refuse_non_finite(value: float, learner, ranks) -> None:
    """Who decides: a non-finite loss on any rank's rows refuses the step on every rank, before any rank's backward
    starts a reduce-scatter the refusing one would never join."""
    refused = ranks.agree(not math.isfinite(value))
    if not refused:
        return
    learner.optimizer.zero_grad(set_to_none=True)  # why: earlier micro-batches' gradients belong to a refused step
    where = f" on rank {', '.join(map(str, refused))}'s rows" if ranks.sharded else ""
    refusal = NonFinite(
        "backward",
        f"loss is {'non-finite' if ranks.sharded else value}{where}",
        "check the rewards and advantages for inf/nan, or lower grpo.learning_rate / grpo.beta",
    )
    refusal.agreed = True  # every rank took this decision together
    raise refusal


def optimizer(learner, config) -> float:
    """Clip, update the LoRA parameters, drop the gradients; returns the pre-clip gradient norm.
    learning_rate, weight_decay and max_grad_norm are read here (live). A non-finite gradient norm is
    refused before the update, non-finite weights after it (the Lab rolls the update back): NaN never
    reaches AdamW's moments or the adapter."""
    grpo = config.grpo
    for group in learner.optimizer.param_groups:  # why here: an edit between steps takes effect at this update
        group["lr"], group["weight_decay"] = grpo.learning_rate, grpo.weight_decay
    params = [p for p in learner.model.parameters() if p.requires_grad]
    grad_norm = learner.sharding.full(torch.nn.utils.clip_grad_norm_(params, grpo.max_grad_norm)).item()  # a DTensor
    if not math.isfinite(grad_norm):
        learner.optimizer.zero_grad(set_to_none=True)  # why: these gradients must never be applied
        raise NonFinite(
            "optimizer",
            f"gradient norm is {grad_norm}",
            "lower grpo.learning_rate or check the rewards and advantages for inf/nan",
        )
    learner.optimizer.step()
    learner.optimizer.zero_grad(set_to_none=True)  # why: gradients are not needed until the next backward
    # one sync for all LoRA tensors
    bad = int(torch.stack([~torch.isfinite(learner.sharding.local(p)).all() for p in params]).sum().item())
    bad = int(runtime().sum([bad])[0])  # a sharded rank checks its shards; every rank refuses together
    if bad:
        raise NonFinite(
            "optimizer",
            f"the update made {bad} of {len(params)} LoRA weights non-finite",
            "lower grpo.learning_rate (or grpo.max_grad_norm)",
        )
    return grad_norm


def sync(generator, learner) -> None:
    """Push the updated LoRA weights to the generator (a no-op when it samples with the learner itself)."""
    generator.sync(learner)


def summarize(
    step_index,
    rollout_: Rollout,
    rewards_: Rewards,
    advantages_: Advantages,
    stats: LossStats,
    grad_norm: float,
    phase_seconds: dict,
    iterations: int,
    attempts: int,
    learning_rate: float,
) -> StepResult:
    total = rewards_.total
    lengths = rollout_.completion_lengths.float()
    if rollout_.tool_mask is not None:  # the model's own tokens, as TRL counts them
        lengths = (rollout_.completion_mask * rollout_.tool_mask).sum(-1).float()
    means = torch.nanmean(rewards_.per_function, dim=0).tolist()
    return StepResult(
        step=step_index,
        reward_mean=torch.nanmean(total).item(),
        reward_std=total[~torch.isnan(total)].std().item() if (~torch.isnan(total)).sum() > 1 else 0.0,
        rewards=dict(zip(rewards_.names, means)),
        logged=dict(rewards_.logged),
        advantage_std=advantages_.values.std().item(),
        loss=stats.loss,
        kl=stats.kl,
        clip_fraction=stats.clip_fraction,
        logprob_mismatch=stats.logprob_mismatch,
        logprob_kl=stats.logprob_kl,
        grad_norm=grad_norm,
        completion_length_mean=lengths.mean().item(),
        completion_length_min=int(lengths.min().item()),
        completion_length_max=int(lengths.max().item()),
        truncated_fraction=rollout_.truncated.float().mean().item(),
        phase_seconds=phase_seconds,
        step_seconds=sum(phase_seconds.values()),
        sync_seconds=phase_seconds.get("sync", 0.0),
        iterations=iterations,
        attempts=attempts,
        generate_calls=rollout_.generate_calls,
        compiled_graphs=rollout_.compiled_graphs,
        cudagraph_recorded_inputs=rollout_.cudagraph_recorded_inputs,
        rollout_copy=rollout_.rollout_copy,
        cudagraph_recordings_expected=rollout_.cudagraph_recordings_expected,
        rollout_experts_dequantized=rollout_.experts_dequantized,
        learner_experts_dequantized=stats.experts_dequantized,
        prefix_cache_hit_rate=rollout_.prefix_cache_hit_rate,
        temperature=rollout_.temperature,
        learning_rate=learning_rate,
        is_ratio_min=stats.is_ratio_min,
        is_ratio_mean=stats.is_ratio_mean,
        is_ratio_max=stats.is_ratio_max,
        **tool_metrics(rollout_),
    )


def tool_metrics(rollout_: Rollout) -> dict:
    """A tool-calling rollout's step metrics: calls per row and failed calls per call (TRL's tools/call_frequency and
    tools/failure_frequency), assistant turns per row; nothing without tools."""
    if rollout_.tool_calls is None:
        return {}
    calls, failures = sum(rollout_.tool_calls), sum(rollout_.tool_failures)
    return {
        "tool_calls_per_row": calls / len(rollout_),
        "tool_failure_frequency": failures / calls if calls else 0.0,
        "turns_mean": sum(rollout_.turns) / len(rollout_),
    }
