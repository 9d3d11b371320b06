"""A mixture of experts' 4-bit experts dequantized for the routed experts alone (models/routed_experts.py): the same
logits as bitsandbytes' whole-layer dequantize (float32, 1e-5), for plain and double-quantized scales, in a forward
and a training backward; a count of the experts dequantized that follows what is routed, with PEFT's expert adapters
(lora.target_experts) folded into the routed experts alone (their gradients: tests/test_expert_lora.py)."""

from __future__ import annotations

import pytest
import torch

from grpo_lab.models.routed_experts import ROUTED, experts_dequantized

pytestmark = pytest.mark.xdist_group("moe")


@pytest.fixture(autouse=True)
def not_held(monkeypatch):
    """The paths these tests pin: a model this small otherwise holds its experts dequantized for a rollout
    (models/held_experts.py; tests/test_held_experts.py)."""
    from grpo_lab.models import held_experts

    monkeypatch.setattr(held_experts, "HELD_BYTES", -1)


def tiny_moe(double_quant: bool, name: str = "builtin:tiny-moe"):
    from grpo_lab.config.models_and_devices import ModelSection
    from grpo_lab.models.learner import load_base
    from grpo_lab.models.source import resolve_model_path

    path = resolve_model_path(name)
    cfg = ModelSection(
        name_or_path=path, dtype="float32", bnb_4bit_compute_dtype="float32", bnb_4bit_use_double_quant=double_quant
    )
    return load_base(cfg, "cpu")


def whole_layer(model, ids, train: bool = False):
    """The logits (and, training, the embedding's input gradient) with today's whole-layer dequantize."""
    model.config._experts_implementation = "grouped_mm"
    try:
        return forward(model, ids, train)
    finally:
        model.config._experts_implementation = ROUTED


def forward(model, ids, train: bool = False):
    if not train:
        with torch.no_grad():
            return model(ids).logits, None
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds).logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), embeds.grad


@pytest.mark.parametrize("name", ["builtin:tiny-moe", "builtin:tiny-qwen2-moe"])  # (Qwen2-MoE: a shared expert)
@pytest.mark.parametrize("double_quant", [False, True])
def test_routed_experts_give_the_logits_and_gradients_of_the_whole_layer_dequantize(double_quant, name):
    model = tiny_moe(double_quant, name)
    assert model.config._experts_implementation == ROUTED
    decode = torch.randint(0, 384, (3, 1), generator=torch.Generator().manual_seed(0))  # a decoding step of 3 rows
    before = experts_dequantized(model)
    ours, _ = forward(model, decode)
    routed = experts_dequantized(model) - before
    assert 2 <= routed <= 2 * 3 * 2  # 2 layers, 3 tokens x top-2: at most 6 of 8 experts a layer
    theirs, _ = whole_layer(model, decode)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    batch = torch.randint(0, 384, (2, 10), generator=torch.Generator().manual_seed(1))
    (ours, ours_grad), (theirs, theirs_grad) = forward(model, batch, True), whole_layer(model, batch, True)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-5, atol=1e-7)


def test_the_count_follows_what_is_routed_with_expert_adapters_too(monkeypatch):
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization

    from grpo_lab import load_config
    from grpo_lab.models.learner import add_lora

    model = tiny_moe(True)
    one = torch.tensor([[5]])
    with torch.no_grad():
        model(one)
    assert experts_dequantized(model) == 2 * 2  # one token: its top-2 experts in each of the 2 layers
    config = load_config("tiny-cpu", ["model.name_or_path=builtin:tiny-moe", "lora.target_experts=true"])
    adapted = add_lora(model, config)
    whole = []  # bitsandbytes' whole-parameter dequantizes (PEFT's registration check read them, twice a layer)
    real = Bnb4bitParametrization.forward
    monkeypatch.setattr(Bnb4bitParametrization, "forward", lambda self, q: whole.append(1) or real(self, q))
    with torch.no_grad():
        adapted(input_ids=one)
    assert experts_dequantized(model) == 2 * (2 * 2) and not whole  # W + B A folded into the routed experts alone


def test_the_plans_experts_dequantized_line_follows_what_the_prompts_prefill_routes():
    """Qwen3-30B-A3B's 128 experts, top-8: 8 rows of 1-token prompts route to at most 64 a layer, half its experts'
    bytes (with expert adapters too); 32 rows, or 8 rows of 256-token prompts (the prefill, not a decoding step), to
    all of them."""
    from grpo_lab import load_config
    from grpo_lab.models.shapes import load_shape
    from grpo_lab.planner import plan
    from grpo_lab.planner.estimate import experts_dequant_bytes

    base = ["model.name_or_path=builtin:qwen3-30b-a3b-random", "grpo.prompts_per_step=1"]
    shape = load_shape("builtin:qwen3-30b-a3b-random")
    whole = experts_dequant_bytes(shape, load_config("qwen2.5-7b-nf4-24gb", base))
    cases = [(8, 1, 64, []), (32, 1, 128, []), (8, 1, 64, ["lora.target_experts=true"]), (8, 256, 128, [])]
    for rows, prompt, routed, extra in cases:
        sets = [f"grpo.num_generations={rows}", f"generator.max_prompt_length={prompt}", *extra]
        config = load_config("qwen2.5-7b-nf4-24gb", [*base, *sets])
        line = next(i for i in plan(config).devices["cuda:0"].items if i.what == "experts dequantized (one layer)")
        assert line.bytes == whole * routed / 128 and f"{routed} of 128 experts" in line.note, (rows, line)
        assert f"rows x {prompt} prompt tokens a forward" in line.note, line.note


@pytest.mark.parametrize("adapters", [False, True])
def test_a_backward_that_dequantizes_the_experts_again_gives_todays_gradients_and_keeps_no_dequantized_expert(adapters):
    """Without gradient checkpointing (RedequantizedExperts): the same logits and gradients (the embeddings' and the
    expert adapters') as autograd keeping the dequantized experts, within 1e-5; what autograd keeps for backward is
    smaller by at least both layers' dequantized experts; the backward dequantizes the routed experts again."""
    from grpo_lab import load_config
    from grpo_lab.models.learner import add_lora

    knobs = ["model.name_or_path=builtin:tiny-moe", "model.dtype=float32", "model.bnb_4bit_compute_dtype=float32"]
    knobs += ["lora.target_experts=true", "lora.expert_r=2"] if adapters else []
    models = []
    for redequantize in (False, True):
        model = tiny_moe(True)
        for m in model.modules():
            if hasattr(m, "redequantize"):
                m.redequantize = redequantize
        torch.manual_seed(0)
        model = add_lora(model, load_config("tiny-cpu", [*knobs, "model.gradient_checkpointing=false"]))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        models.append(model)
    batch = torch.randint(0, 384, (2, 10), generator=torch.Generator().manual_seed(1))
    results, kept, counts = [], [], []
    for model in models:
        model.train()
        seen: dict[int, int] = {}
        pack = lambda t, seen=seen: seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) and t
        embeds = model.get_input_embeddings()(batch).detach().requires_grad_(True)
        start = experts_dequantized(model)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(inputs_embeds=embeds).logits
        middle = experts_dequantized(model)
        logits.float().pow(2).mean().backward()
        counts.append((middle - start, experts_dequantized(model) - middle))  # (forward, backward)
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results.append((logits.detach(), embeds.grad, grads))
        kept.append(sum(seen.values()))
    (ours, ours_embeds, ours_grads), (theirs, theirs_embeds, theirs_grads) = results[1], results[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_embeds, theirs_embeds, rtol=1e-5, atol=1e-7)
    assert ours_grads.keys() == theirs_grads.keys() and any(".experts." in n for n in ours_grads) == adapters
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, theirs_grads[name], rtol=1e-5, atol=1e-7)
    routed = counts[0][0]  # both layers' routed experts (of 8 each), dequantized to float32 by the forward
    assert kept[0] - kept[1] >= routed * (2 * 64 * 128 + 128 * 64) * 4, (kept, routed)
    assert counts == [(routed, 0), (routed, routed)]  # the backward dequantizes the same routed experts again


def test_the_experts_forward_again_in_backward_runs_under_the_forwards_autocast():
    """A learner's forwards run under torch.autocast (bfloat16 on a GPU): backward's forward again must run so too, or
    its gradients are another precision's. (On the CPU the experts' grouped matmuls are not autocast ops, so the tiny
    MoE's gradients cannot show it; the state each run saw can.)"""
    from grpo_lab.models.routed_experts import RedequantizedExperts

    seen = []

    def run(hidden, index, weights, factors):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return hidden * weights.sum(-1, keepdim=True)

    hidden = torch.randn(3, 4, requires_grad=True)
    weights = torch.rand(3, 2, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = RedequantizedExperts.apply(run, hidden, torch.zeros(3, 2, dtype=torch.long), weights)
    out.sum().backward()
    assert seen == [(True, torch.bfloat16)] * 2 and hidden.grad is not None and weights.grad is not None
