"""A small mixture of experts' layers held dequantized for a rollout (models/held_experts.py): the logits of
bitsandbytes' whole-layer dequantize (float32, 1e-5) at a decoding step (every expert at once) and a prefill
(grouped_mm over the held experts), with PEFT's expert adapters too; made once and made again when the adapters
change; dropped by a training forward and at a rollout's end; a model over the bound dequantizes a step as before;
the plan counts what is held; the load makes a decoding step's matmul kernels."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo_lab.models import held_experts
from grpo_lab.models.routed_experts import ROUTED, experts_dequantized

pytestmark = pytest.mark.xdist_group("moe")


def moe(adapters: bool = False, dtype: str = "float32"):
    """builtin:tiny-moe's learner model (nf4 experts, double-quantized scales); `adapters`: LoRA on its experts too,
    their B matrices random (PEFT starts them at 0, which would hide the adapters' term)."""
    from grpo_lab import load_config
    from grpo_lab.models.learner import add_lora, load_base

    knobs = [f"model.dtype={dtype}", f"model.bnb_4bit_compute_dtype={dtype}", "lora.target_experts=true"]
    config = load_config("tiny-cpu", ["model.name_or_path=builtin:tiny-moe", *knobs, "lora.expert_r=2"])
    model = load_base(config.model, "cpu")
    if adapters:
        torch.manual_seed(0)
        model = add_lora(model, config)
        randomize(model, 1)
    return model


def randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def layers(model) -> list:
    return [m for m in model.modules() if hasattr(m, "held_total")]


def logits(model, ids, implementation: str = ROUTED):
    """No-gradient logits with `implementation`: ROUTED, or transformers' grouped_mm (the whole-layer dequantize)."""
    for m in layers(model):
        m.config._experts_implementation = implementation
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits
    finally:
        for m in layers(model):
            m.config._experts_implementation = ROUTED


@pytest.mark.parametrize("adapters", [False, True])
def test_a_decoding_step_and_a_prefill_from_the_held_experts_give_the_whole_layers_logits(adapters):
    model = moe(adapters)
    decode = torch.randint(0, 384, (3, 1), generator=torch.Generator().manual_seed(0))  # 3 rows, one token each
    prefill = torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(1))  # 80 tokens: grouped_mm
    assert 80 > held_experts.DENSE_TOKENS >= 3
    ours = logits(model, decode)
    assert experts_dequantized(model) == 2 * 8  # each layer's 8 experts, once
    assert all(m.held is not None for m in layers(model))
    torch.testing.assert_close(ours, logits(model, decode, "grouped_mm"), rtol=1e-5, atol=1e-5)
    before = experts_dequantized(model)
    torch.testing.assert_close(logits(model, prefill), logits(model, prefill, "grouped_mm"), rtol=1e-5, atol=1e-5)
    logits(model, decode)
    assert experts_dequantized(model) == before  # the held experts read again, nothing dequantized


def test_changed_expert_adapters_make_the_held_experts_again():
    """An optimizer's step changes the adapters in place between rollouts; the held experts follow them."""
    model = moe(adapters=True)
    decode = torch.randint(0, 384, (4, 1), generator=torch.Generator().manual_seed(2))
    first = logits(model, decode)
    made = experts_dequantized(model)
    randomize(model, 7)
    second = logits(model, decode)
    assert experts_dequantized(model) == made + 2 * 8
    assert not torch.allclose(first, second, atol=1e-4)
    torch.testing.assert_close(second, logits(model, decode, "grouped_mm"), rtol=1e-5, atol=1e-5)


def test_codes_written_in_place_make_the_held_experts_again():
    """A decoding step past the checks (held_experts.ready) still sees codes written in place (a load of weights)."""
    model = moe()
    decode = torch.randint(0, 384, (4, 1), generator=torch.Generator().manual_seed(4))
    before = logits(model, decode)
    codes = layers(model)[0].parametrizations.gate_up_proj.original
    with torch.no_grad():
        codes.copy_(codes.view(8, -1).roll(1, 0).view_as(codes))  # each expert's codes moved to the next one
    after = logits(model, decode)
    assert not torch.allclose(before, after, atol=1e-4)
    torch.testing.assert_close(after, logits(model, decode, "grouped_mm"), rtol=1e-5, atol=1e-5)


def test_a_training_forward_and_a_rollouts_end_drop_the_held_experts():
    from grpo_lab import Lab

    knobs = ["model.name_or_path=builtin:tiny-moe", "generator.max_completion_length=6", "grpo.num_generations=4"]
    lab = Lab("tiny-cpu", overrides=[*knobs, "grpo.prompts_per_step=1"], reward_funcs=["length"]).load()
    try:
        model = lab.learner.model
        seen = []  # whether each layer held its experts at each rollout forward
        hooks = [m.register_forward_hook(lambda m, i, o: seen.append(m.held is not None)) for m in layers(model)]
        rollout = lab.rollout()
        for hook in hooks:
            hook.remove()
        assert seen and all(seen) and len(seen) > 2 * 2  # the prefill and the decoding steps, in both layers
        assert rollout.experts_dequantized == 2 * 8  # each layer's experts once, at the prefill
        assert all(m.held is None for m in layers(model))  # dropped at the rollout's end
        decode = torch.randint(0, 384, (2, 1), generator=torch.Generator().manual_seed(3))
        logits(model, decode)
        model(input_ids=decode).logits.sum().backward()  # a forward with gradients: the routed dequantize
        assert all(m.held is None for m in layers(model))
    finally:
        lab.close()


def test_a_model_over_the_bound_dequantizes_the_routed_experts_a_step(monkeypatch):
    model = moe()
    monkeypatch.setattr(held_experts, "HELD_BYTES", layers(model)[0].held_total - 1)
    logits(model, torch.tensor([[5]]))
    assert experts_dequantized(model) == 2 * 2  # one token's top-2 in each layer
    assert all(getattr(m, "held", None) is None for m in layers(model))


def test_the_plan_counts_the_held_experts_where_the_rule_holds_them():
    from grpo_lab import load_config
    from grpo_lab.planner import plan

    model = moe(dtype="bfloat16")
    held = layers(model)[0].held_total
    config = load_config("tiny-cpu", ["model.name_or_path=builtin:tiny-moe", "model.dtype=bfloat16"])
    items = {i.what: i for i in plan(config).devices["host"].items}
    down = 8 * 128 * 64 * 2  # one layer's down_proj, transposed beside the held experts
    assert config.grpo.num_generations * config.grpo.prompts_per_step * config.generator.max_prompt_length > 64
    rows = 64  # a prefill's tokens up to DENSE_TOKENS read every expert: their activations and padded hidden states
    active = rows * (8 * (2 * 64 + 64 + 64) + 128) * 2
    assert items["experts held (every layer)"].bytes == held + down + active
    assert "experts dequantized (one layer)" not in items
    big = load_config("qwen2.5-7b-nf4-24gb", ["model.name_or_path=builtin:qwen3-30b-a3b-random"])
    names = {i.what for i in plan(big).devices["cuda:0"].items}
    assert "experts dequantized (one layer)" in names and "experts held (every layer)" not in names


class GateUpRows(torch.overrides.TorchFunctionMode):
    """The rows of every `torch.mm` call on the held experts' gate_up_proj (transposed: `shape`)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.rows = shape, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.mm and tuple(args[1].shape) == self.shape:
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


def test_decoding_steps_run_padded_to_a_power_of_two_of_at_least_eight_rows():
    """As a rollout's rows leave, a decoding step's 7, 5, 3, 1 tokens run as 8 rows (one oneDNN kernel for them all),
    9 as 16; the padded rows cut off, the logits the whole layer's; the plan's rows follow the same rule."""
    from grpo_lab.planner.experts_items import dense_rows

    model = moe()
    g = torch.Generator().manual_seed(6)
    for tokens, rows in [(7, 8), (5, 8), (3, 8), (1, 8), (9, 16), (8, 8)]:
        decode = torch.randint(0, 384, (tokens, 1), generator=g)
        with GateUpRows((128, 8 * 2 * 64)) as seen:
            ours = logits(model, decode)
        assert seen.rows == [rows, rows]  # both layers
        assert ours.shape[0] == tokens
        torch.testing.assert_close(ours, logits(model, decode, "grouped_mm"), rtol=1e-5, atol=1e-5)
    config = SimpleNamespace(generator=SimpleNamespace(max_prompt_length=1))
    assert [dense_rows(config, n) for n in (1, 6, 9, 40, 64, 200)] == [8, 8, 16, 64, 64, 64]


def test_a_decoding_step_with_the_modules_own_gate_gives_the_same_result():
    """dense_forward's in-place SiLU gate (transformers' default, checked at the making) and the module's own
    `_apply_gate` agree, padded rows and all."""
    model = moe()
    logits(model, torch.tensor([[5], [7], [9]]))
    module = layers(model)[0]
    held = dict(module.held[1])
    assert held["gate"]  # Qwen3-MoE's experts: the default gate
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(5, 128, generator=g)
    index = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(5)])
    weights = torch.softmax(torch.randn(5, 2, generator=g), -1)
    with torch.no_grad():
        fast = held_experts.dense_forward(module, held, hidden, index, weights)
        own = held_experts.dense_forward(module, {**held, "gate": False}, hidden, index, weights)
    assert fast.shape == (5, 128) and fast.abs().sum() > 0
    torch.testing.assert_close(fast, own, rtol=0, atol=0)


def test_a_decoding_steps_matmul_kernels_are_made_at_load(monkeypatch, capfd):
    """oneDNN makes a bfloat16 matmul's kernel at the first call of a shape; the load makes the held experts' two
    (held_experts.warm), so a rollout's first decoding step finds them made. MIN_ROWS 24 (never a power of two's
    padding): kernels no earlier test in this process made."""
    monkeypatch.setattr(held_experts, "MIN_ROWS", 24)
    model = moe(dtype="bfloat16")
    decode = torch.randint(0, 384, (5, 1), generator=torch.Generator().manual_seed(8))
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
        logits(model, decode)
    made = [line for line in capfd.readouterr().out.splitlines() if line.split(",")[3:4] and "create" in line]
    held = [line for line in made if line.split(",")[-2] in ("24x128:128x1024", "24x512:512x128")]
    if not made:
        pytest.skip("this CPU's bfloat16 matmuls are not oneDNN's")
    assert all(m.held is not None for m in layers(model))
    assert len(held) == 2 * 2 and all("cache_hit" in line for line in held), held  # both layers, both matmuls
