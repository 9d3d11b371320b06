"""LoRA on a mixture of experts' fused experts in nf4 (lora.target_experts, models/expert_lora.py): PEFT's
target_parameters over bitsandbytes' 4-bit parametrization. Before the mending, with both gate_up_proj and down_proj
adapted the inner wrapper's adapters got no gradient (a stale parametrization cache) and the next forward failed (a
proxy PEFT left behind); now every expert adapter gets the gradient the same experts give dequantized to plain
tensors, the 4-bit base stays bit for bit, the plan counts the adapters, a checkpoint carries them, and what cannot
carry them is refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import parametrize

from grpo_lab import Lab, LabError, load_config
from grpo_lab.models.shapes import load_shape
from grpo_lab.planner.estimate import planned_lora

pytestmark = pytest.mark.xdist_group("moe")

TINY_MOE = "builtin:tiny-moe"
TINY_MOES = [TINY_MOE, "builtin:tiny-qwen2-moe"]  # (Qwen2-MoE: with a shared expert)
EXPERTS = ["model.name_or_path=builtin:tiny-moe", "lora.target_experts=true", "lora.expert_r=2"]


def experts_on(name: str) -> list[str]:
    return [f"model.name_or_path={name}", *EXPERTS[1:]]


FLOAT32 = ["model.dtype=float32", "model.bnb_4bit_compute_dtype=float32", "model.gradient_checkpointing=false"]


def base_digest(model) -> str:
    from test_moe import base_digest as digest

    return digest(model)


def expert_adapters(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad and ".experts." in n}


def learner(config, dequantized: bool = False):
    """The learner model of `config` (nf4 experts), or the same model with its experts dequantized to plain float32
    parameters first (PEFT's own path, which trains both targets)."""
    from grpo_lab.models.learner import add_lora, load_base

    base = load_base(config.model, "cpu")
    if dequantized:
        for module in list(base.modules()):
            for name in list(getattr(module, "parametrizations", {}) or {}):
                value = getattr(module, name).detach().clone()  # the experts dequantized, as every forward reads them
                parametrize.remove_parametrizations(module, name, leave_parametrized=False)
                module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    torch.manual_seed(0)
    return add_lora(base, config)


def by_target(model) -> dict[tuple, torch.nn.Parameter]:
    """Each expert adapter matrix by (experts module, parameter, A or B): PEFT nests the two wrappers in another order
    over 4-bit parameters than over plain ones, so their names differ."""
    from peft.tuners.lora.layer import ParamWrapper

    return {
        (name.replace(".base_layer", ""), m.parameter_name, ab): getattr(m, f"lora_{ab}")["default"].weight
        for name, m in model.named_modules()
        if isinstance(m, ParamWrapper)
        for ab in "AB"
    }


def backward(model, ids) -> dict[tuple, torch.Tensor]:
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    grads = {k: p.grad.clone() for k, p in by_target(model).items()}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("name", TINY_MOES)
@pytest.mark.parametrize("experts_forward", ["routed", "grouped_mm"])
def test_both_nf4_expert_targets_get_the_gradients_of_the_same_experts_dequantized_and_the_base_stays_bit_for_bit(
    experts_forward, name
):
    """`routed`: the lab's forward (models/routed_experts.py) folds the adapters into the routed experts; `grouped_mm`:
    transformers' own reads the parametrized parameter whole, through PEFT's proxy (where the gradient was lost)."""
    config = load_config("tiny-cpu", experts_on(name) + FLOAT32)
    nf4, plain = learner(config), learner(config, dequantized=True)
    if experts_forward == "grouped_mm":
        nf4.config._experts_implementation = "grouped_mm"
    adapters = expert_adapters(nf4)
    # both wrappers of each layer's experts: gate_up_proj's (outer) and down_proj's (nested: `base_layer.`)
    assert len(adapters) == 2 * 2 * 2 and sum(".base_layer.lora_" in n for n in adapters) == 4
    g, twins = torch.Generator().manual_seed(1), by_target(plain)
    with torch.no_grad():
        for key, p in by_target(nf4).items():  # B off 0, so A's gradient is not 0 either
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 if key[2] == "B" else p)
            twins[key].copy_(p)
    before = base_digest(nf4)
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the second forward: PEFT's proxies from the first are gone
        ours, theirs = backward(nf4, ids), backward(plain, ids)
        assert len(ours) == len(theirs) == 2 * 2 * 2
        for key, grad in ours.items():
            assert grad.abs().sum() > 0, key
            torch.testing.assert_close(grad, theirs[key], rtol=1e-4, atol=1e-6)
        chains = [len(m.parametrizations[k]) for m in nf4.modules() if parametrize.is_parametrized(m) for k in
                  m.parametrizations]  # fmt: skip
        assert chains == [1] * 4  # bitsandbytes' dequantization alone, between forwards
    assert base_digest(nf4) == before


@pytest.mark.parametrize("name", TINY_MOES)
def test_the_cpu_plan_saves_what_torch_saves_with_expert_adapters(name):
    """Without checkpointing the experts' backward dequantizes them again (models/routed_experts.py), so beyond
    what the frozen experts keep (their input, routing weights) the adapters add PEFT's factors alone, and the routed
    copies' inputs to both fused matmuls are remade in backward. Within 0.9-1.1 as test_moe's: the plan's 4h of
    norms' tensors over-counts the shared-expert MoE's (the experts read the post-attention norm's output), 0.945."""
    from test_planner_saved import measured_and_planned

    measured, planned = measured_and_planned(name, ("lora.target_experts=true", "lora.expert_r=2"))
    assert 0.9 <= measured / planned <= 1.1, (measured / 2**20, planned / 2**20)


def test_gradient_checkpointing_recomputes_the_expert_adapters_to_the_same_gradients():
    """Non-reentrant checkpointing stops its recompute early (by an exception) inside the wrappers' forward: PEFT's
    proxies must still come off, and the recomputed experts read W + B A again."""
    off = learner(load_config("tiny-cpu", EXPERTS + FLOAT32))
    on = learner(load_config("tiny-cpu", EXPERTS + FLOAT32[:2] + ["model.gradient_checkpointing=true"]))
    on.train()
    g, twins = torch.Generator().manual_seed(1), by_target(on)
    with torch.no_grad():
        for key, p in by_target(off).items():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 if key[2] == "B" else p)
            twins[key].copy_(p)
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        ours, theirs = backward(on, ids), backward(off, ids)
        for key, grad in ours.items():
            assert grad.abs().sum() > 0, key
            torch.testing.assert_close(grad, theirs[key], rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module", params=TINY_MOES)
def expert_lab(request):
    lab = Lab(
        "tiny-cpu",
        overrides=[
            *experts_on(request.param),
            "generator.max_completion_length=8",
            "grpo.num_generations=4",
            "grpo.prompts_per_step=2",
        ],
        reward_funcs=["length", lambda completions, **kw: [float(i % 3) for i in range(len(completions))]],
    ).load()
    yield lab
    lab.close()


def test_the_plan_counts_the_expert_adapters_the_model_trains(expert_lab):
    model, config = expert_lab.learner.model, expert_lab.config
    shape = load_shape(config.model.name_or_path)
    experts = sum(p.numel() for p in expert_adapters(model).values())
    assert experts == shape.expert_lora_params(config.lora.expert_r) > 0
    trainable = sum(p.numel() for p in expert_lab.learner.trainable_parameters().values())
    assert trainable == planned_lora(shape, config) == shape.lora_params(config.lora.r, "all-linear") + experts
    from grpo_lab.planner import plan
    from grpo_lab.planner.render import count

    assert f"LoRA r={config.lora.r} ({count(trainable)})" in str(plan(config))


def test_a_step_trains_the_expert_adapters_keeps_the_base_and_a_checkpoint_resumes_them(expert_lab, tmp_path):
    model = expert_lab.learner.model
    base = base_digest(model)
    first = {n: p.detach().clone() for n, p in expert_adapters(model).items()}
    for _ in range(2):  # (B starts at 0: A's gradient is 0 until B has moved once)
        expert_lab.step()
    moved = [n for n, p in expert_adapters(model).items() if not torch.equal(p, first[n])]
    assert sorted(moved) == sorted(first)  # every expert adapter, gate_up_proj's and down_proj's (nested) alike
    assert base_digest(model) == base
    kept = {n: p.detach().clone() for n, p in expert_adapters(model).items()}
    rollout = expert_lab.rollout()
    expert_lab.backward(rollout, expert_lab.advantages(expert_lab.rewards(rollout)), expert_lab.logprobs(rollout))
    expert_lab.optimizer()
    assert not all(torch.equal(p, kept[n]) for n, p in expert_adapters(model).items())  # updated, then rolled back
    expert_lab.rollback()
    assert all(torch.equal(p, kept[n]) for n, p in expert_adapters(model).items()) and base_digest(model) == base
    expert_lab.step()  # the step's update again
    path = expert_lab.save_checkpoint(tmp_path / "ckpt")
    saved = {n: p.detach().clone() for n, p in expert_adapters(model).items()}
    expert_lab.step()
    expert_lab.restore_checkpoint(path)
    assert all(torch.equal(p, saved[n]) for n, p in expert_adapters(model).items())
    assert base_digest(model) == base


@pytest.mark.parametrize(
    "knobs, field",
    [
        (["lora.target_experts=true"], "lora.target_experts: "),  # the tiny dense model
        ([*EXPERTS, "lora.lora_dropout=0.1"], "lora.lora_dropout: 0.1"),
        # (why vLLM cannot: its CPU LoRA has no fused-MoE path; not the MoE learner's general vLLM refusal)
        ([*EXPERTS, "generator.backend=vllm"], "generator.backend: vllm cannot serve adapters on fused experts"),
        ([*EXPERTS, "generator.hf_decode=merged"], "generator.hf_decode: merged"),
    ],
)
def test_expert_lora_where_it_cannot_go_is_refused_in_one_line_naming_the_field_and_the_fix(knobs, field):
    from grpo_lab.preflight import check_experts

    with pytest.raises(LabError) as err:
        check_experts(load_config("tiny-cpu", knobs))
    message = str(err.value)
    assert message.startswith(field) and "\n" not in message and ("set " in message or "use " in message)


def dequantized_base(config):
    """The base of `config` with its experts dequantized to plain parameters of model.dtype (its attention stays in
    nf4, as the lab's), run by transformers' own grouped_mm: the model TRL gets."""
    from grpo_lab.models.learner import load_base

    base = load_base(config.model, "cpu")
    for module in list(base.modules()):
        for name in list(getattr(module, "parametrizations", {}) or {}):
            value = getattr(module, name).detach().clone()
            parametrize.remove_parametrizations(module, name, leave_parametrized=False)
            module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    base.config._experts_implementation = "grouped_mm"
    return base


@pytest.mark.parametrize("name", TINY_MOES)
def test_expert_lora_matches_trl_with_peft_target_parameters_on_the_same_experts(name, tmp_path):
    """TRL 1.16's GRPOTrainer, given the same experts dequantized to float32 and PEFT's LoraConfig with the experts as
    target_parameters (its own wrap, its own `_compute_loss`, fed our completions and reference log-probs as
    tests/test_trl_parity.py does): the loss within 1e-5, every expert adapter's gradient within 1e-4 of its norm,
    with every B moved off 0 first; and the lab's 4-bit base bit for bit through it."""
    from peft import LoraConfig
    from test_trl_parity import assert_grads_close, ended_rollout, lora_grads, trl_trainer, uneven

    from grpo_lab.algo import grpo as phases
    from grpo_lab.algo.containers import LogProbs
    from grpo_lab.models.expert_lora import expert_lora_kwargs, quiet_expert_ranks
    from grpo_lab.models.learner import moe_linear_targets

    lab = Lab(
        "tiny-cpu",
        overrides=[*experts_on(name), *FLOAT32, "grpo.prompts_per_step=2", "grpo.num_generations=4",
                   "generator.max_completion_length=10", "generator.temperature=1.0", "data.system_prompt=null"],
        reward_funcs=["exact_answer", "format", uneven],
    ).load()  # fmt: skip
    try:
        rollout = ended_rollout(lab)
        rewards = lab.rewards(rollout)
        ours_model = lab.learner.model
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for key, p in by_target(ours_model).items():
                if key[2] == "B":
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            for n, p in ours_model.named_parameters():
                if "lora_B" in n and ".experts" not in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        before = base_digest(ours_model)
        ref = phases.logprobs(lab.learner, lab.reference, rollout, lab.config).ref
        theirs_base = dequantized_base(lab.config)
        lora = lab.config.lora
        peft_config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.lora_alpha,
            target_modules=moe_linear_targets(theirs_base, lora.target_modules),
            task_type="CAUSAL_LM",
            **expert_lora_kwargs(theirs_base, lora),
        )
        with quiet_expert_ranks():
            trainer, inputs = trl_trainer(
                lab, rollout, tmp_path, model=theirs_base, peft_config=peft_config, router_aux_loss_coef=0.0
            )
        theirs_model = trainer.model
        twins, names = by_target(theirs_model), dict(theirs_model.named_parameters())
        with torch.no_grad():  # our adapters into TRL's (float32: TRL cast a 4-bit model's LoRA to bf16)
            for key, p in by_target(ours_model).items():
                twins[key].data = p.detach().clone()
            for n, p in ours_model.named_parameters():
                if p.requires_grad and ".experts" not in n:
                    names[n].data = p.detach().clone()
        batch = trainer._generate_and_score_completions(inputs)
        advantages = phases.advantages(rewards, lab.config.grpo.scale_rewards)
        ours = phases.backward(lab.learner, rollout, advantages, LogProbs(ref=ref), lab.config, None).stats
        ours_grads = {key: p.grad.clone() for key, p in by_target(ours_model).items()}
        ours_rest = {n: g for n, g in lora_grads(ours_model).items() if ".experts" not in n}
        batch["ref_per_token_logps"] = ref
        batch.pop("old_per_token_logps", None)
        theirs_model.train()
        loss = trainer._compute_loss(theirs_model, batch)
        loss.backward()
        theirs, theirs_rest = loss.item(), {n: p.grad for n, p in theirs_model.named_parameters() if p.requires_grad}
        theirs_grads = {key: p.grad for key, p in by_target(theirs_model).items()}
        assert base_digest(ours_model) == before
    finally:
        lab.close()
    assert ours.kl > 1e-5  # the policy is not the reference: the KL term's weight matters
    assert ours.loss == pytest.approx(theirs, rel=1e-5, abs=1e-9)
    assert len(ours_grads) == 2 * 2 * 2 and all(g.abs().sum() > 0 for g in ours_grads.values())
    assert_grads_close(ours_grads, theirs_grads)
    assert_grads_close(ours_rest, {n: theirs_rest[n] for n in ours_rest})
