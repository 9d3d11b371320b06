"""Parity with TRL 1.16's GRPOTrainer, driving TRL's own code (not a copy of it).

TRL gets our completions through its public `rollout_func` hook and our reward functions; its
`_generate_and_score_completions` computes the advantages (and, sent down its vLLM branch, the
importance-sampling ratio) and its `_compute_loss` the loss and clip metrics, on the same PEFT model,
with our old/reference log-probs fed in. All must match grpo_lab's within 1e-5.

`grpo.use_bias_correction_kl` (TRL's default, True: the KL term weighted by the PPO ratio) goes to TRL
as the lab has it; the off-policy cases run it both ways.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from grpo_lab import Lab
from grpo_lab.algo.logprobs import rollout_logprobs, set_logprob_head

pytestmark = pytest.mark.xdist_group("trl_parity")  # why: its tests share module-scoped state: one worker builds it


def trl_trainer(lab, rollout, tmp_path, sampler_logprobs=None, model=None, peft_config=None, **overrides):
    """A GRPOTrainer on the lab's model (or TRL's own `model`, which it wraps in `peft_config`) whose `rollout_func`
    returns `rollout`'s completions and its sampler log-probs (or `sampler_logprobs` [N, L]; NaN goes to TRL as None,
    as vLLM sends it); `overrides` are GRPOConfig fields. Returns the trainer and the inputs for its
    `_generate_and_score_completions`."""
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
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        bf16=False,  # TRL's default runs its forward under bf16 autocast; both sides compute in float32 here
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=cfg.grpo.num_generations,
        max_completion_length=cfg.generator.max_completion_length,
        temperature=cfg.generator.temperature,
        beta=cfg.grpo.beta,
        loss_type=cfg.grpo.loss_type,
        scale_rewards=cfg.grpo.scale_rewards,
        epsilon=cfg.grpo.epsilon,
        epsilon_high=cfg.epsilon_high,
        num_iterations=cfg.grpo.num_iterations,
        mask_truncated_completions=cfg.grpo.mask_truncated_completions,
        gradient_checkpointing=False,
        reward_weights=cfg.data.reward_weights,
        use_bias_correction_kl=cfg.grpo.use_bias_correction_kl,
        **overrides,
    )
    # grpo_lab's side scores at the rollout's temperature, as lab.step sets it per rollout
    set_logprob_head(lab.learner.model, temperature=rollout.logprob_temperature)
    dataset = Dataset.from_list(
        [{"prompt": p, "answer": a} for p, a in zip(rollout.batch.prompts, rollout.batch.answers)]
    )
    dtypes = {name: p.dtype for name, p in lab.learner.model.named_parameters() if p.requires_grad}
    trainer = GRPOTrainer(
        model=lab.learner.model if model is None else model,
        peft_config=peft_config,
        reward_funcs=lab.reward_funcs,
        args=args,
        train_dataset=dataset,
        processing_class=lab.learner.tokenizer,
        rollout_func=rollout_func,
    )
    # why: TRL casts a 4-bit model's LoRA weights to bf16 (the QLoRA recipe); grpo_lab keeps them in float32,
    # and gradients compare at float32 precision only in float32
    for name, p in lab.learner.model.named_parameters():
        if name in dtypes:
            p.data = p.data.to(dtypes[name])
    trainer.current_gradient_accumulation_steps = 1
    inputs = [
        {"prompt": p, "answer": a}
        for p, a in zip(rollout.repeated(rollout.batch.prompts), rollout.repeated(rollout.batch.answers))
    ]
    return trainer, inputs


def vllm_importance_sampling(trainer, mode, clip_min, clip_max):
    """Send the trainer down its vLLM importance-sampling path (`use_vllm` is set after construction, so no
    vLLM engine is built; the completions still come from `rollout_func`, which TRL then treats as vLLM's)."""
    trainer.use_vllm = True
    trainer._last_loaded_step = trainer.state.global_step  # why: nothing to sync, there is no vLLM engine
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min = clip_min
    trainer.vllm_importance_sampling_clip_max = clip_max


@pytest.fixture
def closing_lab(tiny_config):
    """A loaded Lab, closed after the test (why: an open Lab's memory sampler keeps polling, and a dozen of
    them slow every later test of the session)."""
    labs = []

    def make(**sections):
        labs.append(Lab(tiny_config(**sections)).load())
        return labs[-1]

    yield make
    for lab in labs:
        lab.close()


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]
SCALES = ["group", "batch", "none"]


def uneven(completions, **kwargs):
    """Rewards that differ inside every group and not symmetrically (0, 1, 3, 6, ...), whatever was sampled."""
    return [float((i % 4) * (i % 4 + 1) // 2) for i in range(len(completions))]


def end_some_at_eos(rollout, eos: int, pad: int, cuts=(3, None, 5, 9, None, 2, 7, None, 11, 4, None, 6)):
    """The tiny model rarely samples EOS: end rows at EOS after `cuts[i]` tokens (None: as sampled), in place (the
    Lab checks that later phases get this very rollout), so lengths vary and some completions end, some are cut."""
    for i, cut in enumerate(cuts[: len(rollout)]):
        if cut is None or cut >= int(rollout.completion_lengths[i]):
            continue
        rollout.completion_ids[i, cut - 1] = eos
        rollout.completion_ids[i, cut:] = pad  # the padding after EOS, as the generators pad
        rollout.completion_mask[i, cut:] = 0
        rollout.sampler_logprobs[i, cut:] = 0
        rollout.truncated[i] = False
    return rollout


def ended_rollout(lab):
    """The lab's next rollout with some rows ended at EOS (`end_some_at_eos`) and their texts decoded again:
    several ended completions whatever the sampler drew, on any CPU."""
    tokenizer = lab.learner.tokenizer
    rollout = end_some_at_eos(lab.rollout(), tokenizer.eos_token_id, tokenizer.pad_token_id)
    rollout.completions = tokenizer.batch_decode(
        [ids[:k] for ids, k in zip(rollout.completion_ids.tolist(), rollout.completion_lengths.tolist())],
        skip_special_tokens=True,
    )
    return rollout


@pytest.fixture(scope="module")
def varied(tiny_model, tmp_path_factory):
    """A batch where the loss variants differ: completion lengths vary, some truncated and some ended at EOS,
    rewards differ within groups; one TRL trainer on the same model, and TRL's own advantages per scale_rewards.
    Every case starts from the same LoRA and AdamW state (a snapshot put back)."""
    from grpo_lab.algo import grpo as phases
    from grpo_lab.recovery.rollback import RollbackSnapshot

    lab = Lab(
        {  # float32 throughout; not 4-bit: the loss's arithmetic is the same, and 48 cases stay within ~30 s
            "model": {
                "name_or_path": tiny_model,
                "dtype": "float32",
                "load_in_4bit": False,
                "gradient_checkpointing": False,
            },
            "lora": {"r": 8, "lora_alpha": 16},
            "grpo": {"beta": 0.04, "prompts_per_step": 2, "num_generations": 4, "learning_rate": 2e-2, "epsilon": 0.05},
            "generator": {"temperature": 1.0, "max_completion_length": 10, "max_prompt_length": 128},
            "data": {"system_prompt": None},  # why: short prompts; the loss is over completions
        },
        reward_funcs=["exact_answer", "format", "length", uneven],
    ).load()
    rollout = ended_rollout(lab)
    lengths = rollout.completion_lengths
    assert rollout.truncated.any() and (~rollout.truncated).any() and len(set(lengths.tolist())) > 4, lengths
    rewards = lab.rewards(rollout)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B != 0, as after earlier steps: the policy is not the reference, so the KL term is not 0
        for name, p in lab.learner.trainable_parameters().items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ref = phases.logprobs(lab.learner, lab.reference, rollout, lab.config).ref
    trainer, inputs = trl_trainer(lab, rollout, tmp_path_factory.mktemp("trl"))
    batches = {}
    for scale in SCALES:  # TRL's own advantages (and its batch, padded as it pads) per scale_rewards
        trainer.scale_rewards = scale
        batches[scale] = trainer._generate_and_score_completions(inputs)
        assert torch.equal(batches[scale]["completion_ids"].cpu(), rollout.completion_ids)
    yield SimpleNamespace(
        lab=lab,
        rollout=rollout,
        rewards=rewards,
        ref=ref,
        trainer=trainer,
        batches=batches,
        start=RollbackSnapshot(lab.learner),
    )
    lab.close()


def run_case(varied, loss_type, scale, beta, iterations, level="token"):
    """grpo_lab's loss and LoRA gradients on the case's last iteration (the second: off-policy, ratios != 1), and
    TRL's `_compute_loss` on the same weights, old and reference log-probs."""
    from grpo_lab.algo import grpo as phases
    from grpo_lab.algo.containers import LogProbs

    lab, trainer = varied.lab, varied.trainer
    varied.start.restore(lab.learner)
    cfg = lab.config.model_copy()  # unguarded: the phase functions read it, the Lab's reference stays as it is
    cfg.update(
        {
            "grpo.loss_type": loss_type,
            "grpo.scale_rewards": scale,
            "grpo.beta": beta,
            "grpo.num_iterations": iterations,
            "grpo.importance_sampling_level": level,
        }
    )
    advantages = phases.advantages(varied.rewards, scale)
    batch = dict(varied.batches[scale])
    torch.testing.assert_close(batch["advantages"].cpu(), advantages.values, rtol=1e-5, atol=1e-6)
    logprobs = LogProbs(ref=varied.ref if beta > 0 else None)
    old = None  # the first backward records the old log-probs; later iterations are given them
    for _ in range(iterations - 1):  # earlier iterations: their updates move the policy off the sampler's weights
        old = phases.backward(lab.learner, varied.rollout, advantages, logprobs, cfg, old).old_logprobs
        phases.optimizer(lab.learner, cfg)
    ours = phases.backward(lab.learner, varied.rollout, advantages, logprobs, cfg, old).stats
    batch["ref_per_token_logps"] = varied.ref
    if iterations > 1:
        batch["old_per_token_logps"] = old
    else:
        batch.pop("old_per_token_logps", None)
    trainer.loss_type, trainer.beta, trainer.importance_sampling_level = loss_type, beta, level
    theirs, theirs_grads = trl_loss_and_grads(trainer, lab.learner.model, batch)
    return ours, lora_grads(lab.learner.model), theirs, theirs_grads


@pytest.mark.parametrize("iterations", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_every_loss_variant_matches_trl_in_loss_and_gradients(varied, beta, iterations):
    """loss_type x scale_rewards x beta x num_iterations against TRL's own `_compute_loss` and advantages: loss within
    1e-5 of its value, every LoRA gradient within 1e-4 of its norm. On this batch the variants differ (below), so a
    wrong normalisation or KL weight cannot pass."""
    grads = {}
    for loss_type in LOSS_TYPES:
        for scale in SCALES:
            ours, ours_grads, theirs, theirs_grads = run_case(varied, loss_type, scale, beta, iterations)
            assert ours.loss == pytest.approx(theirs, rel=1e-5, abs=1e-9), (loss_type, scale)
            assert_grads_close(ours_grads, theirs_grads)
            grads[loss_type, scale] = torch.cat([g.flatten() for g in ours_grads.values()])
            if iterations == 2:
                assert ours.clip_fraction > 0  # the second iteration is off-policy: ratios left 1 and were clipped
            if beta:
                assert ours.kl > 1e-4  # the policy is not the reference: the KL term's weight matters

    def differ(a, b) -> bool:
        return ((grads[a] - grads[b]).norm() / grads[b].norm()).item() > 1e-3

    for scale in SCALES:
        # grpo (per-sequence mean), the token mean and dr_grpo give gradients far apart beyond the tolerance above
        # (on-policy at beta 0 their loss values are all 0: the advantages sum to 0 in each group)...
        for a, b in (("grpo", "dapo"), ("grpo", "dr_grpo"), ("dapo", "dr_grpo")):
            assert differ((a, scale), (b, scale)), (a, b, scale)
        # ...and bnpo equals dapo by design: both normalise over the whole step batch (algo/losses.py; TRL's bnpo
        # normalises per micro-batch, which on one micro-batch, as here, is the same number)
        assert not differ(("bnpo", scale), ("dapo", scale))
    for loss_type in LOSS_TYPES:  # so do the reward scalings
        assert differ((loss_type, "group"), (loss_type, "none")) and differ((loss_type, "batch"), (loss_type, "none"))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gspo_sequence_level_matches_trl(varied, loss_type):
    """importance_sampling_level: sequence (GSPO) on the off-policy iteration: loss and LoRA gradients within 1e-5
    of TRL's, and different from the token level's."""
    token = run_case(varied, loss_type, "group", 0.04, 2, "token")[0]
    ours, ours_grads, theirs, theirs_grads = run_case(varied, loss_type, "group", 0.04, 2, "sequence")
    assert ours.loss == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    assert_grads_close(ours_grads, theirs_grads, rel=1e-5)
    assert ours.loss != pytest.approx(token.loss, rel=1e-3)


def noisy_sampler(rollout, seed=0, nan_at=()):
    """Sampler log-probs off the learner's by seeded noise: per token uniform in [-2, 2] around its row's
    mean, and the row means set so that the summed log-ratios spread evenly over [-2.5, 2.5] among the
    truncated completions and among the ended ones alike. Token and sequence ratios then fall below, inside
    and above TRL's bounds (0.5, 3), with or without truncated completions masked. NaN (no log-prob from the
    sampler) at the (row, token) pairs `nan_at`."""
    g = torch.Generator().manual_seed(seed)
    mask = rollout.completion_mask.float()
    lengths = mask.sum(1).clamp(min=1)
    noise = (torch.rand(mask.shape, generator=g) * 4 - 2) * mask
    noise = noise - (noise.sum(1) / lengths).unsqueeze(1)  # zero mean per row
    shift = torch.empty(len(rollout))
    for rows in (rollout.truncated, ~rollout.truncated):
        index = rows.nonzero().flatten()
        # why from +2.5 down: a lone ended completion (the sampler's draw decides how many end, and it differs
        # by CPU) still lands above the bound C_max = 3, so the mask modes have a row to mask
        shift[index] = torch.linspace(2.5, -2.5, len(index))[torch.randperm(len(index), generator=g)]
    noise = (noise + (shift / lengths).unsqueeze(1)) * mask  # row i sums to shift[i]
    sampler = (rollout.sampler_logprobs - noise) * mask
    for row, token in nan_at:
        assert mask[row, token], "the NaN must sit on a completion token"
        sampler[row, token] = math.nan
    return sampler


def spread(completions, **kwargs):
    """Rewards 0..3 inside every group of 4, whatever was sampled: every completion gets an advantage."""
    return [float(i % 4) for i in range(len(completions))]


@pytest.fixture
def step(shared, tiny_config, tmp_path_factory):
    """One Lab in the middle of a num_iterations = 2 step, shared by the module: its rollout (sampler log-probs
    noised, so importance sampling has something to correct), rewards, advantages and log-probs, and a TRL
    trainer on the same model. Each test rolls the step's updates back first (lab.rollback keeps the rest)."""
    if not shared:
        lab = Lab(
            tiny_config(
                # small epsilon: one 1e-3 update moves many ratios past it while the KL term stays small
                grpo={
                    "beta": 0.04,
                    "num_iterations": 2,
                    "prompts_per_step": 4,
                    "micro_batch_size": 6,
                    "learning_rate": 1e-3,
                    "epsilon": 0.02,
                },
                generator={"temperature": 0.8},
            ),
            reward_funcs=["exact_answer", "format", "length", spread],
        ).load()
        rollout = ended_rollout(lab)  # why: the mask modes need ended rows, and how many the sampler ends varies by CPU
        # why in place: the lab checks that backward gets the very rollout this step produced
        rollout.sampler_logprobs = noisy_sampler(rollout)
        rewards = lab.rewards(rollout)
        advantages = lab.advantages(rewards)
        logprobs = lab.logprobs(rollout)
        trainer, inputs = trl_trainer(lab, rollout, tmp_path_factory.mktemp("trl"))
        shared.update(
            lab=lab, rollout=rollout, advantages=advantages, logprobs=logprobs, trainer=trainer, inputs=inputs
        )
    s = SimpleNamespace(**shared)
    s.lab.rollback()
    return s


def lora_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def trl_loss_and_grads(trainer, model, batch):
    """TRL's loss and its gradient on the LoRA weights (ours are put back afterwards)."""
    ours = lora_grads(model)
    model.zero_grad(set_to_none=True)
    model.train()
    loss = trainer._compute_loss(model, batch)
    loss.backward()
    theirs = lora_grads(model)
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.grad = ours[n]
    return loss.item(), theirs


def assert_grads_close(ours, theirs, rel=1e-4):
    """Each LoRA tensor's gradient within `rel` of TRL's, in norm (elementwise, float32 sums in a different
    order differ by ~1e-6 absolute, which is large relative to the smallest elements)."""
    for name, g in ours.items():
        err = ((g - theirs[name]).norm() / theirs[name].norm().clamp(min=1e-12)).item()
        assert err < rel, f"{name}: gradient differs from TRL's by {err:.1e} of its norm"


IS_MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
SCENARIOS = {
    "off_policy": ({}, None),
    "off_policy_kl_unweighted": ({"grpo.use_bias_correction_kl": False}, None),
    "epsilon_high": ({"grpo.epsilon_high": 0.06}, None),
    "mask_truncated": ({"grpo.mask_truncated_completions": True}, None),
    **{f"is_{mode}": ({"grpo.importance_sampling_mode": mode}, mode) for mode in IS_MODES},
    **{
        f"is_{mode}_mask_truncated": (
            {"grpo.importance_sampling_mode": mode, "grpo.mask_truncated_completions": True},
            mode,
        )
        for mode in ("token_mask", "sequence_mask")
    },
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_off_policy_loss_matches_trl(step, monkeypatch, name):
    """Both iterations of a num_iterations = 2 step: loss, gradient, KL and clip fraction equal TRL's
    `_compute_loss` with old_per_token_logps = the recorded old log-probs (lab.current.old_logprobs); with importance
    sampling, our weights equal TRL's `importance_sampling_ratio` and its min/mean/max TRL's
    `sampling/importance_sampling_ratio/*`."""
    changes, is_mode = SCENARIOS[name]
    lab, rollout, advantages, logprobs, trainer = step.lab, step.rollout, step.advantages, step.logprobs, step.trainer
    model = lab.learner.model
    lab.configure(
        {
            "grpo.epsilon_high": None,
            "grpo.mask_truncated_completions": False,
            "grpo.use_bias_correction_kl": True,
            **changes,
        }
    )
    cfg = lab.config
    trainer.epsilon_high, trainer.mask_truncated_completions = cfg.epsilon_high, cfg.grpo.mask_truncated_completions
    trainer.args.use_bias_correction_kl = cfg.grpo.use_bias_correction_kl
    trainer.use_vllm = False
    monkeypatch.setattr("grpo_lab.algo.grpo.applies_importance_sampling", lambda config: is_mode is not None)
    if is_mode:
        vllm_importance_sampling(
            trainer, is_mode, cfg.grpo.importance_sampling_clip_min, cfg.grpo.importance_sampling_clip_max
        )
    if cfg.grpo.mask_truncated_completions:
        assert rollout.truncated.any() and (~rollout.truncated).any()

    model.train()  # why: TRL files its metrics under "train" or "eval" by the model's mode
    batch = trainer._generate_and_score_completions(step.inputs)
    metrics = trainer._metrics["train"]
    assert torch.allclose(batch["advantages"].cpu(), advantages.values, atol=1e-5)
    batch["ref_per_token_logps"] = logprobs.ref

    first = lab.backward(rollout, advantages, logprobs)
    batch["old_per_token_logps"] = lab.current.old_logprobs
    with torch.no_grad():
        assert first.loss == pytest.approx(trainer._compute_loss(model, batch).item(), abs=1e-5)
    if is_mode:
        weights = lab.current.is_weights
        torch.testing.assert_close(weights, batch["importance_sampling_ratio"].cpu(), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(weights, torch.ones_like(weights))
        if is_mode.endswith("_mask"):
            assert (weights == 0).any()
        for stat in ("min", "mean", "max"):
            assert getattr(first, f"is_ratio_{stat}") == pytest.approx(
                metrics[f"sampling/importance_sampling_ratio/{stat}"][-1], abs=1e-5
            )
    else:
        assert first.is_ratio_mean is None
    lab.optimizer()

    second = lab.backward(rollout, advantages, logprobs)
    ours_grads = lora_grads(model)
    theirs, theirs_grads = trl_loss_and_grads(trainer, model, batch)
    assert second.loss == pytest.approx(theirs, abs=1e-5)
    assert_grads_close(ours_grads, theirs_grads)
    assert second.kl == pytest.approx(metrics["kl"][-1], rel=1e-4)
    # our clip_fraction is TRL's clip_ratio/region_mean: tokens clipped low (A < 0) or high (A > 0), over the loss mask
    assert second.clip_fraction == pytest.approx(metrics["clip_ratio/region_mean"][-1], abs=1e-6)
    assert second.clip_fraction > 0
    if name == "epsilon_high":  # only a test if some ratios fall between the two bounds, where A > 0
        ratio = torch.exp(rollout_logprobs(model, rollout, lab.learner.device, None) - lab.current.old_logprobs)
        between = (
            (ratio > 1 + cfg.grpo.epsilon) & (ratio <= 1 + cfg.epsilon_high) & (advantages.values > 0).unsqueeze(1)
        )
        assert (between & rollout.completion_mask.bool()).any()


@pytest.mark.parametrize("dim", [None, 0, 1])
def test_the_advantages_nanstd_is_trls(dim):
    """grpo_lab's nanstd (not imported from TRL: that module imports transformers' Trainer) equals TRL's own, with
    NaNs in places, a row with one value left (NaN: no spread) and an all-NaN row."""
    from trl.trainer.utils import nanstd as trls

    from grpo_lab.algo.grpo import nanstd

    values = torch.randn(5, 6, generator=torch.Generator().manual_seed(0)) * torch.arange(1.0, 7.0)
    values[0, 2] = values[1, :5] = values[3] = float("nan")
    ours, theirs = nanstd(values, dim=dim), trls(values, dim=dim)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, equal_nan=True, rtol=0, atol=0)
    if dim == 1:
        assert ours[[1, 3]].isnan().all() and not ours[[0, 2, 4]].isnan().any()
