"""Mixture-of-experts learners (models/experts.py): planned as what they are (a 30B-A3B model was planned as a 3B
dense one: "3.34B params ... fits 21 %"), their fused experts loaded in nf4 with bitsandbytes' own parametrization,
and the whole lab on the built-in tiny Qwen3-MoE: a step, the plan against what torch keeps, the 4-bit base bit for
bit across steps and an out-of-memory rollback, LoRA on attention only; what it cannot do yet, refused in one line."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from grpo_lab import Lab, LabError, cli, load_config
from grpo_lab.models.shapes import ModelShape, load_shape
from grpo_lab.planner import plan
from grpo_lab.planner.estimate import base_weight_bytes

pytestmark = pytest.mark.xdist_group("moe")  # why: its Lab tests share one loaded tiny MoE (module-scoped)

QWEN3_30B = "Qwen/Qwen3-30B-A3B"
TINY_MOE = "builtin:tiny-moe"
# the tiny MoEs the whole lab runs on: Qwen3-MoE (routed experts alone) and Qwen2-MoE (with a shared expert, an MLP
# of width 96 every token goes through, and its sigmoid gate)
TINY_MOES = [TINY_MOE, "builtin:tiny-qwen2-moe"]


def config_of(hub_id: str) -> dict:
    from grpo_lab.models.bundled import BUNDLED, bundled_name

    return json.loads((BUNDLED / f"{bundled_name(hub_id)}.json").read_text())


def test_a_30b_a3b_checkpoint_is_planned_as_its_30b_params_with_its_experts_not_as_a_3b_dense_model(tmp_path, capsys):
    """The user's path: a directory with Qwen3-30B-A3B's config.json, planned with the 24 GB preset. Before, it read
    "3.34B params ... base weights 2.47 GiB ... 21% -> fits" (the experts planned as one dense MLP); now 30.5B, and
    a step on one 24 GiB card at 79 %."""
    (tmp_path / "config.json").write_text(json.dumps(config_of(QWEN3_30B)))
    rc = cli.main(["plan", "qwen2.5-7b-nf4-24gb", "--set", f"model.name_or_path={tmp_path}"])
    out = capsys.readouterr().out
    assert "(30.53B params, nf4)" in out, out.splitlines()[0]
    shape = load_shape(str(tmp_path))
    assert shape.experts == 128 and shape.experts_per_token == 8 and shape.expert_intermediate == 768
    assert 30.4e9 < shape.total_params < 30.6e9 and 3.2e9 < shape.active_params < 3.4e9  # "30B-A3B"
    config = load_config("qwen2.5-7b-nf4-24gb", [f"model.name_or_path={tmp_path}"])
    weights, _ = base_weight_bytes(shape, config.model)
    assert 15 * 2**30 < weights < 16 * 2**30  # 29.0B expert + 0.9B attention weights in nf4, embeddings in bf16
    # the load reads a layer at a time (models/experts.load_experts_checkpoint): one layer's experts in bf16 at once
    assert rc == 0 and "fits" in out and "one layer's experts before nf4" in out
    card = plan(config).devices["cuda:0"]
    assert card.phase_peak("load") < card.phase_peak("rollout") < 24 * 2**30


def test_the_bundled_30b_a3b_shape_plans_offline_and_its_random_builtin_is_planned_without_the_load_line():
    assert load_shape(QWEN3_30B).total_params == load_shape("builtin:qwen3-30b-a3b-random").total_params
    config = load_config("qwen2.5-7b-nf4-24gb", ["model.name_or_path=builtin:qwen3-30b-a3b-random"])
    card = plan(config).devices["cuda:0"]
    assert not [i for i in card.items if i.phase == "load"]  # drawn and quantized a layer at a time
    assert 0.5 < card.phase_peak("rollout") / (24 * 2**30) < 1.0


@pytest.mark.parametrize(
    "change, named",
    [
        ({"model_type": "deepseek_v3", "n_routed_experts": 256}, "'deepseek_v3' is a mixture-of-experts model"),
        ({"model_type": "gpt2", "num_experts": None, "num_experts_per_tok": None}, "'gpt2' is not an architecture"),
        ({"mlp_only_layers": [0, 3]}, "dense MLP layers among its expert layers"),
        ({"num_experts_per_tok": 0}, "'num_experts_per_tok'"),
    ],
)
def test_an_architecture_the_planner_cannot_read_is_refused_in_one_line_naming_it(tmp_path, capsys, change, named):
    (tmp_path / "config.json").write_text(json.dumps({**config_of(QWEN3_30B), **change}))
    with pytest.raises(LabError) as err:
        load_shape(str(tmp_path))
    assert named in str(err.value) and "\n" not in str(err.value) and "model.name_or_path" in str(err.value)
    assert cli.main(["plan", "qwen2.5-7b-nf4-24gb", "--set", f"model.name_or_path={tmp_path}"]) == 2
    assert named in capsys.readouterr().err


def test_every_mixture_of_experts_family_the_planner_names_counts_its_experts():
    """Qwen2-MoE has a shared expert every token goes through; Mixtral spells its experts num_local_experts."""
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 100}
    common = {**base, "num_experts_per_tok": 2, "intermediate_size": 32}
    qwen2 = ModelShape.from_config(
        {
            **common,
            "model_type": "qwen2_moe",
            "num_experts": 4,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 48,
        }  # fmt: skip
    )
    assert (qwen2.experts, qwen2.expert_intermediate, qwen2.shared_intermediate) == (4, 16, 48)
    assert qwen2.expert_params == 2 * 4 * 3 * 64 * 16 and ("down_proj", 48, 64) in qwen2.linear_layers()
    mixtral = ModelShape.from_config({**common, "model_type": "mixtral", "num_local_experts": 8})
    olmoe = ModelShape.from_config({**common, "model_type": "olmoe", "num_experts": 8})
    for shape in (mixtral, olmoe):
        assert (shape.experts, shape.expert_intermediate) == (8, 32)
        assert [n for n, _, _ in shape.linear_layers()] == ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize(
    "knob, field",
    [
        ("generator.hf_decode=merged", "generator.hf_decode: merged"),
        ("placement.learner_procs=2", "placement.learner_procs: 2"),
    ],
)
def test_what_a_mixture_of_experts_learner_cannot_do_yet_is_refused_before_anything_loads(knob, field):
    from grpo_lab.preflight import check_experts

    config = load_config("tiny-cpu", [f"model.name_or_path={TINY_MOE}", knob])
    with pytest.raises(LabError) as err:
        check_experts(config)
    assert str(err.value).startswith(field) and "mixture-of-experts" in str(err.value) and "\n" not in str(err.value)
    check_experts(load_config("tiny-cpu", [knob]))  # a dense model: nothing refused here
    auto = load_config("tiny-cpu", [f"model.name_or_path={TINY_MOE}", "generator.hf_decode=auto"])
    from grpo_lab.planner.plan import rollout_decode

    assert rollout_decode(auto) == "dynamic"  # auto never picks the dense copy of the experts


def base_digest(model) -> str:
    """Every frozen tensor of the model (4-bit codes, quant state, the experts' codes), bit for bit."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if "lora_" in name or not torch.is_tensor(t):
            continue
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def varied(completions, **kwargs):
    """Rewards that differ inside every group whatever was sampled (random weights rarely differ otherwise)."""
    return [float(i % 3) for i in range(len(completions))]


@pytest.fixture(scope="module", params=TINY_MOES)
def moe_lab(request):
    lab = Lab(
        "tiny-cpu",
        overrides=[
            f"model.name_or_path={request.param}",
            "generator.max_completion_length=16",
            "grpo.num_generations=4",
            "grpo.prompts_per_step=2",
        ],
        reward_funcs=["length", varied],
    ).load()
    yield lab
    lab.close()


def test_the_experts_are_nf4_lora_is_on_attention_only_and_the_plan_counts_what_loaded(moe_lab):
    from torch.nn.utils import parametrize

    model, shape = moe_lab.learner.model, load_shape(moe_lab.config.model.name_or_path)
    experts = [m for m in model.modules() if parametrize.is_parametrized(m, "gate_up_proj")]
    assert len(experts) == 2 and all(parametrize.is_parametrized(m, "down_proj") for m in experts)
    codes = experts[0].parametrizations.gate_up_proj.original
    assert codes.dtype == torch.uint8 and codes.numel() == 8 * 2 * 64 * 128 // 2  # two 4-bit codes a byte
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    # attention's and a shared expert's MLP: not the routers, not a shared expert's gate, not the experts
    assert trainable and all("self_attn" in n or "shared_expert." in n for n in trainable)
    assert any("shared_expert." in n for n in trainable) == bool(shape.shared_intermediate)
    assert sum(p.numel() for p in trainable.values()) == shape.lora_params(8, "all-linear")
    # the plan's base weights: every parameter and quant-state tensor that loaded, within 5 %
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for n, t in model.state_dict().items()
                if "lora_" not in n and torch.is_tensor(t)}  # fmt: skip
    loaded = sum(storages.values())  # (the tied head and embedding are one storage)
    planned, _ = base_weight_bytes(shape, moe_lab.config.model)
    assert 0.95 < loaded / planned < 1.05, (loaded, planned)


@pytest.mark.parametrize("name", TINY_MOES)
def test_the_cpu_plan_saves_what_torch_saves_for_a_mixture_of_experts_backward(name):
    """The experts' working memory as transformers runs it (grouped_mm), a shared expert's as a dense MLP: without
    checkpointing, the experts keep their input and routing weights alone (their backward dequantizes them again,
    models/routed_experts.RedequantizedExperts; the dequantized experts are not among what autograd keeps:
    tests/test_routed_experts.py)."""
    from test_planner_saved import measured_and_planned

    measured, planned = measured_and_planned(name)
    assert 0.9 <= measured / planned <= 1.1, (measured / 2**20, planned / 2**20)


def test_a_step_trains_attention_lora_and_keeps_the_4bit_base_and_experts_bit_for_bit_through_an_oom_rollback(moe_lab):
    model = moe_lab.learner.model
    base = base_digest(model)
    first = moe_lab.step()
    assert first.grad_norm > 0 and base_digest(model) == base
    lora = {n: p.detach().clone() for n, p in moe_lab.learner.trainable_parameters().items()}
    moe_lab.arm_fault(0, "backward", "oom")
    with pytest.raises(LabError, match="out of memory"):
        moe_lab.step()
    assert all(torch.equal(p, lora[n]) for n, p in moe_lab.learner.trainable_parameters().items())
    again = moe_lab.step()  # the step runs again from the failed phase
    assert again.step == first.step + 1 and base_digest(model) == base
    moved = [n for n, p in moe_lab.learner.trainable_parameters().items() if not torch.equal(p, lora[n])]
    assert moved  # the retried step updated the adapters


def test_the_steps_metrics_count_the_experts_its_rollout_and_its_backward_dequantized(moe_lab, monkeypatch):
    """Each forward through a layer dequantizes the experts its tokens route to: counted here from the routers' own
    top-k (a hook on every gate), per phase; the backward's with checkpointing: its forward and the recompute. (A
    model this small otherwise holds its experts for the rollout, counted once a layer: tests/test_held_experts.py.)"""
    from grpo_lab.models import held_experts

    monkeypatch.setattr(held_experts, "HELD_BYTES", -1)
    routed = []  # each router call's distinct experts
    gates = [m.mlp.gate for m in moe_lab.learner.model.base_model.model.model.layers]  # (the routers, not
    # a shared expert's gate)
    hooks = [g.register_forward_hook(lambda m, i, out: routed.append(out[2].unique().numel())) for g in gates]
    try:
        rollout = moe_lab.rollout()
        in_rollout, routed[:] = sum(routed), []
        moe_lab.logprobs(rollout)  # (the adapter-disabled reference: not the learner's backward)
        routed[:] = []
        result = moe_lab.step()
    finally:
        for hook in hooks:
            hook.remove()
    assert result.rollout_experts_dequantized == in_rollout > 0
    assert result.learner_experts_dequantized == sum(routed) > 0
    assert result.metrics()["rollout_experts_dequantized"] == in_rollout
    decoding_steps = 2 * result.completion_length_max  # a forward a token, in each of the 2 layers
    assert in_rollout < 8 * decoding_steps  # 8 rows x top-2 of 8 experts: never every expert at every step


def test_a_checkpoint_of_a_mixture_of_experts_lab_resumes_to_the_same_adapters(moe_lab, tmp_path):
    moe_lab.step()
    path = moe_lab.save_checkpoint(tmp_path / "ckpt")
    saved = {n: p.detach().clone() for n, p in moe_lab.learner.trainable_parameters().items()}
    moe_lab.step()  # moves on past the checkpoint
    moe_lab.restore_checkpoint(path)
    assert all(torch.equal(p, saved[n]) for n, p in moe_lab.learner.trainable_parameters().items())


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_a_mixture_of_experts_learner_matches_trl_in_loss_and_gradients(loss_type, tmp_path):
    """TRL 1.16's GRPOTrainer on the same nf4-experts model and batch (its `_compute_loss`, fed our completions and
    reference log-probs, as tests/test_trl_parity.py does for the dense model): loss within 1e-5, every LoRA gradient
    within 1e-4 of its norm; B moved off 0 first, so the KL term and the gradients through the experts are not 0.
    TRL's default load-balancing loss is set to 0 on its side (below)."""
    from test_trl_parity import assert_grads_close, ended_rollout, lora_grads, trl_loss_and_grads, trl_trainer, uneven

    from grpo_lab.algo import grpo as phases
    from grpo_lab.algo.containers import LogProbs

    lab = Lab(
        {
            "model": {
                "name_or_path": TINY_MOE,
                "dtype": "float32",
                "bnb_4bit_compute_dtype": "float32",
                "gradient_checkpointing": False,
            },
            "grpo": {"beta": 0.04, "prompts_per_step": 2, "num_generations": 4, "loss_type": loss_type},
            "generator": {"temperature": 1.0, "max_completion_length": 10, "max_prompt_length": 128},
            "data": {"system_prompt": None},
        },
        reward_funcs=["exact_answer", "format", uneven],
    ).load()
    try:
        rollout = ended_rollout(lab)
        rewards = lab.rewards(rollout)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in lab.learner.trainable_parameters().items():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        ref = phases.logprobs(lab.learner, lab.reference, rollout, lab.config).ref
        # why 0: TRL 1.16 adds a mixture of experts' load-balancing loss (router_aux_loss_coef from its config, 0.001
        # for Qwen3-MoE); grpo_lab adds none (its routers are frozen: that loss could only reach attention's LoRA)
        trainer, inputs = trl_trainer(lab, rollout, tmp_path, router_aux_loss_coef=0.0)
        batch = trainer._generate_and_score_completions(inputs)
        advantages = phases.advantages(rewards, lab.config.grpo.scale_rewards)
        torch.testing.assert_close(batch["advantages"].cpu(), advantages.values, rtol=1e-5, atol=1e-6)
        ours = phases.backward(lab.learner, rollout, advantages, LogProbs(ref=ref), lab.config, None).stats
        ours_grads = lora_grads(lab.learner.model)
        batch["ref_per_token_logps"] = ref
        batch.pop("old_per_token_logps", None)
        theirs, theirs_grads = trl_loss_and_grads(trainer, lab.learner.model, batch)
    finally:
        lab.close()
    assert ours.kl > 1e-5  # the policy is not the reference: the KL term's weight matters
    assert ours.loss == pytest.approx(theirs, rel=1e-5, abs=1e-9)
    assert_grads_close(ours_grads, theirs_grads)


def test_a_checkpoint_is_read_a_layer_at_a_time_into_the_same_nf4_model_from_pretrained_then_quantizing_makes(
    monkeypatch,
):
    """load_experts_checkpoint against from_pretrained + quantize_experts: every tensor bit for bit and the same
    logits; and while it reads, never more than one layer's experts in 16-bit (from_pretrained holds every layer's:
    56 GiB at 30B-A3B)."""
    from torch.nn.utils import parametrize

    import grpo_lab.models.experts as experts
    import grpo_lab.models.meta_load as meta_load
    from grpo_lab.config.models_and_devices import ModelSection
    from grpo_lab.models.learner import _from_pretrained, quantization_config
    from grpo_lab.models.quant import pin_training_layout
    from grpo_lab.models.source import resolve_model_path

    path = resolve_model_path(TINY_MOE)
    cfg = ModelSection(name_or_path=path, dtype="float32", bnb_4bit_compute_dtype="float32")
    whole = _from_pretrained(path, cfg, "cpu")
    experts.quantize_experts(whole, cfg)
    built, in_16_bit = [], []
    real_meta, real_quantize = meta_load.meta_model, experts.quantize_experts

    def recorded(*args, **kwargs):
        built.append(real_meta(*args, **kwargs))
        return built[-1]

    def watched(module, model_cfg, recurse=True):  # at each quantization: the model's experts read and in 16-bit
        read = [m._parameters[n] for m, n in experts.fused_experts(built[0]) if m._parameters[n].device.type != "meta"]
        in_16_bit.append(len(read))
        return real_quantize(module, model_cfg, recurse)

    monkeypatch.setattr(meta_load, "meta_model", recorded)
    monkeypatch.setattr(experts, "quantize_experts", watched)
    by_layer = experts.load_experts_checkpoint(path, cfg, "cpu", quantization_config(cfg))
    assert in_16_bit == [2, 2]  # each layer's gate_up_proj and down_proj, then quantized before the next is read
    a, b = whole.state_dict(), by_layer.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sum(parametrize.is_parametrized(m, "gate_up_proj") for m in by_layer.modules()) == 2
    for lm in (whole, by_layer):
        pin_training_layout(lm)
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(whole(ids).logits, by_layer(ids).logits)
