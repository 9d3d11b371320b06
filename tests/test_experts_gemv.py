"""The routed experts' matmuls from their 4-bit codes at decode (models/experts_gemv.py, bitsandbytes' fused CPU
kernel) against the routed dequantize (models/routed_experts.py): the same outputs within bfloat16's matmul tolerance
(the kernel rounds the scales to bfloat16 and accumulates its own way), with PEFT's expert adapters too; the same
greedy rollout; nothing dequantized and counted so; the codes' layout bitsandbytes' own and put back before anything
reads them blockwise. Each path is forced: the fused one needs a CPU with AVX512-BF16 (skipped elsewhere, said so),
the dequantize one is forced by bitsandbytes' `has_avx512bf16` answering no, as on such a CPU."""

from __future__ import annotations

import pytest
import torch

from grpo_lab.models import experts_gemv
from grpo_lab.models.experts_gemv import gemv_kernel
from grpo_lab.models.routed_experts import experts_dequantized

pytestmark = [
    pytest.mark.xdist_group("moe"),
    pytest.mark.skipif(not gemv_kernel(), reason="bitsandbytes' fused CPU 4-bit kernel needs AVX512-BF16"),
]


@pytest.fixture(autouse=True)
def not_held(monkeypatch):
    """The paths these tests pin: a model this small otherwise holds its experts dequantized for a rollout
    (models/held_experts.py; tests/test_held_experts.py)."""
    from grpo_lab.models import held_experts

    monkeypatch.setattr(held_experts, "HELD_BYTES", -1)


BF16 = ["model.dtype=bfloat16", "model.bnb_4bit_compute_dtype=bfloat16"]
# bfloat16's matmul tolerance: torch's own rtol for bfloat16 (2^-6), and 2^-6 of the largest output as atol (the kernel
# rounds the scales to bfloat16 and sums in its own order; the logits differ by a bfloat16 ulp or two)
RTOL = 2**-6


def close(ours, theirs) -> None:
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=RTOL * theirs.abs().max().item())


def dequantize_only(monkeypatch) -> None:
    """The routed dequantize alone, as on a CPU without AVX512-BF16 (bitsandbytes registers no fused kernel there)."""
    from bitsandbytes import functional

    monkeypatch.setattr(functional, "has_avx512bf16", lambda: False)


def bf16_moe(name: str, adapters: bool, dtype: str = "bfloat16"):
    """`name`'s learner model in `dtype` (nf4 experts, double-quantized scales); `adapters`: LoRA on its experts too,
    their B matrices random (PEFT starts them at 0, which would hide the adapters' term)."""
    from grpo_lab import load_config
    from grpo_lab.models.learner import add_lora, load_base

    knobs = [f"model.dtype={dtype}", f"model.bnb_4bit_compute_dtype={dtype}", "lora.target_experts=true"]
    config = load_config("tiny-cpu", [f"model.name_or_path={name}", *knobs, "lora.expert_r=2"])
    model = load_base(config.model, "cpu")
    if not adapters:
        return model
    torch.manual_seed(0)
    model = add_lora(model, config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def counts(model) -> tuple[int, int]:
    return experts_dequantized(model), experts_dequantized(model, "experts_fused")


@pytest.mark.parametrize("adapters", [False, True])
@pytest.mark.parametrize("name", ["builtin:tiny-moe", "builtin:tiny-qwen2-moe"])  # (Qwen2-MoE: a shared expert)
def test_a_decoding_step_from_the_codes_gives_the_dequantize_paths_logits_and_dequantizes_nothing(
    name, adapters, monkeypatch
):
    model = bf16_moe(name, adapters)
    decode = torch.randint(0, 384, (3, 1), generator=torch.Generator().manual_seed(0))  # 3 rows, one token each
    with monkeypatch.context() as patched, torch.no_grad():
        dequantize_only(patched)
        theirs = model(input_ids=decode).logits  # (first: from the blockwise codes, as bitsandbytes stores them)
    ran, fused_before = counts(model)
    assert fused_before == 0 and 2 <= ran <= 2 * 3 * 2  # 2 layers, 3 tokens x top-2 of 8 experts
    with torch.no_grad():
        fused = model(input_ids=decode).logits
    assert counts(model) == (ran, ran)  # the same routed experts, run from their codes, none dequantized
    close(fused, theirs)


@pytest.mark.parametrize("adapters", [False, True])
def test_one_layer_with_many_tokens_an_expert_matches_the_routed_dequantize(adapters, monkeypatch):
    """The kernel takes several rows an expert (a prefill's): 48 tokens x top-2 of 8 experts, about 12 each, through
    the first layer's experts (PEFT's wrapper, with adapters: it registers them for the forward)."""
    model = bf16_moe("builtin:tiny-moe", adapters)
    layer = model.get_decoder().layers[0].mlp.experts
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(48, model.config.hidden_size, generator=g).to(torch.bfloat16)
    index = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(48)])
    weights = torch.softmax(torch.randn(48, 2, generator=g), -1).to(torch.bfloat16)
    with monkeypatch.context() as patched, torch.no_grad():
        dequantize_only(patched)
        theirs = layer(hidden, index, weights)
    assert counts(model) == (8, 0)
    with torch.no_grad():
        ours = layer(hidden, index, weights)
    assert counts(model) == (8, 8)
    close(ours, theirs)


def test_the_codes_are_bitsandbytes_cpu_layout_and_go_back_blockwise_before_a_blockwise_read(monkeypatch):
    """The permutation is bitsandbytes' own `_convert_weight_packed_for_cpu` (its private converter, the oracle) and
    is undone exactly; after a fused step, the routed dequantize (its gathered slices put back), the whole-parameter
    dequantize, `state_dict` and a training forward read what they read before it, bit for bit."""
    import copy

    from bitsandbytes import functional
    from test_moe import base_digest

    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    codes, state = functional.quantize_4bit(weight, quant_type="nf4")
    theirs, _ = functional._convert_weight_packed_for_cpu(codes.clone(), copy.deepcopy(state))
    ours = experts_gemv.to_kernel_layout(codes.view(1, 64, 64))
    assert torch.equal(ours[0], theirs) and torch.equal(experts_gemv.to_blockwise_layout(ours).view(-1, 1), codes)

    model = bf16_moe("builtin:tiny-moe", adapters=False)
    layer = next(m for m in model.modules() if hasattr(m, "experts_fused"))
    ids = torch.randint(0, 384, (2, 6), generator=torch.Generator().manual_seed(4))
    digest, whole, trained = base_digest(model), layer.gate_up_proj.clone(), model(input_ids=ids).logits.detach()
    with monkeypatch.context() as patched, torch.no_grad():
        dequantize_only(patched)
        decoded = model(input_ids=ids[:, :1]).logits
    with torch.no_grad():
        model(input_ids=ids[:, :1])
    packed = layer.parametrizations.gate_up_proj[0].packed
    assert layer.experts_fused > 0 and packed.any()
    with monkeypatch.context() as patched, torch.no_grad():
        dequantize_only(patched)
        assert torch.equal(model(input_ids=ids[:, :1]).logits, decoded) and packed.any()  # (slices put back alone)
    assert torch.equal(layer.gate_up_proj, whole)  # bitsandbytes' dequantize of the whole parameter
    assert base_digest(model) == digest  # state_dict: the blockwise codes
    with torch.no_grad():
        model(input_ids=ids[:, :1])
    assert torch.equal(model(input_ids=ids).logits.detach(), trained)  # (a forward with gradients: dequantized)
    assert not layer.parametrizations.gate_up_proj[0].packed.any() and base_digest(model) == digest


def test_a_decode_under_inference_mode_leaves_the_experts_usable_outside_it():
    """torch.inference_mode (a reward model's, a user's): what the fused step marks is a normal tensor, so a training
    forward after it puts the codes back blockwise and reads the weights it read before."""
    model = bf16_moe("builtin:tiny-moe", adapters=False)
    ids = torch.randint(0, 384, (2, 4), generator=torch.Generator().manual_seed(6))
    trained = model(input_ids=ids).logits.detach()
    with torch.inference_mode():
        model(input_ids=ids[:, :1])
    assert counts(model)[1] > 0
    assert torch.equal(model(input_ids=ids).logits.detach(), trained)


def test_the_fused_path_is_for_decode_alone(monkeypatch):
    """Gradients on (a learner's forward), more tokens an expert than the cut-off (a long prefill), float32, a CPU
    without the kernel: each dequantizes the routed experts."""
    ids = torch.randint(0, 384, (2, 4), generator=torch.Generator().manual_seed(5))
    model = bf16_moe("builtin:tiny-moe", adapters=False)
    model(input_ids=ids)
    assert counts(model)[1] == 0 and counts(model)[0] > 0
    monkeypatch.setattr(experts_gemv, "GEMV_TOKENS", 1)  # 8 tokens x top-2 of 8 experts: some expert gets two
    with torch.no_grad():
        model(input_ids=ids)
    assert counts(model)[1] == 0
    monkeypatch.setattr(experts_gemv, "GEMV_TOKENS", 8)
    with torch.no_grad():
        model(input_ids=ids)
    assert counts(model)[1] > 0
    float32 = bf16_moe("builtin:tiny-moe", adapters=False, dtype="float32")
    with torch.no_grad():
        float32(input_ids=ids[:, :1])
    assert counts(float32)[1] == 0 and counts(float32)[0] > 0
    dequantize_only(monkeypatch)
    before = counts(model)
    with torch.no_grad():
        model(input_ids=ids[:, :1])
    assert counts(model)[1] == before[1] and counts(model)[0] > before[0]


def test_a_greedy_rollout_from_the_codes_gives_the_dequantize_paths_tokens_and_counts_what_it_dequantized(monkeypatch):
    """builtin:tiny-moe in bfloat16, greedy: the same completions both ways, and their log-probs within bfloat16's
    tolerance (the random tiny model greedily repeats one token, so the tokens alone would say little). The rollout's
    metric counts the experts its forwards dequantized: none from the codes; with the cut-off at 4 tokens an expert,
    the prefill's alone (its busiest expert gets more). The reference's log-probs (no gradients either) dequantize,
    as the policy's training forward does, so the two are computed alike."""
    from grpo_lab import Lab

    overrides = ["model.name_or_path=builtin:tiny-moe", *BF16, "generator.temperature=0",
                 "generator.max_completion_length=6", "grpo.num_generations=2", "grpo.prompts_per_step=2"]  # fmt: skip
    lab = Lab("tiny-cpu", overrides=overrides, reward_funcs=["length"]).load()
    try:
        gates = [m.mlp.gate for m in lab.learner.model.base_model.model.model.layers]
        busy = []  # per router call: (its distinct experts, its busiest expert's tokens)
        hook = lambda m, i, out: busy.append((out[2].unique().numel(), int(out[2].reshape(-1).bincount().max())))
        hooks = [g.register_forward_hook(hook) for g in gates]
        fused = lab.rollout()
        assert fused.experts_dequantized == 0 and busy
        model, ran = lab.learner.model, experts_dequantized(lab.learner.model, "experts_fused")
        lab.logprobs(fused)  # the reference's pass (grad off): scored as the policy's training forward runs
        assert experts_dequantized(model, "experts_fused") == ran and experts_dequantized(model) > 0
        monkeypatch.setattr(experts_gemv, "GEMV_TOKENS", 4)  # (a decoding step: 4 rows x top-2, at most 4 an expert)
        busy.clear()
        prefill = lab.rollout()
        assert prefill.experts_dequantized == sum(n for n, most in busy if most > 4) > 0
        dequantize_only(monkeypatch)
        busy.clear()
        theirs = lab.rollout()
        assert theirs.experts_dequantized == sum(n for n, _ in busy) > prefill.experts_dequantized
        assert torch.equal(fused.completion_ids, theirs.completion_ids) and fused.completions == theirs.completions
        close(fused.sampler_logprobs, theirs.sampler_logprobs)
    finally:
        for h in locals().get("hooks", []):
            h.remove()
        lab.close()


def test_a_training_step_reads_the_kept_kernel_layout_bit_for_bit(monkeypatch):
    """With KERNEL_LAYOUT_KEPT, after a fused decode the codes stay in the kernel's layout through a training forward
    and backward (each reads its routed experts' slices back into a temporary): the same logits and expert-adapter
    gradients, bit for bit, as from the blockwise codes, and the experts still in the kernel's layout after it."""
    monkeypatch.setattr(experts_gemv, "KERNEL_LAYOUT_KEPT", True)
    model = bf16_moe("builtin:tiny-moe", adapters=True)
    layer = next(m for m in model.modules() if hasattr(m, "experts_fused"))
    ids = torch.randint(0, 384, (2, 6), generator=torch.Generator().manual_seed(7))

    def trained():
        model.zero_grad()
        logits = model(input_ids=ids).logits
        logits.float().square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if "lora" in n and p.grad is not None}
        return logits.detach(), grads

    logits, grads = trained()
    assert any("experts" in n for n in grads)
    with torch.no_grad():
        model(input_ids=ids[:, :1])
    packed = layer.parametrizations.gate_up_proj[0].packed.clone()
    assert packed.any()
    again, regrads = trained()
    assert torch.equal(again, logits) and grads.keys() == regrads.keys()
    assert all(torch.equal(regrads[n], g) for n, g in grads.items())
    assert torch.equal(layer.parametrizations.gate_up_proj[0].packed, packed)  # kept: nothing permuted back


@pytest.mark.parametrize("fault", ["first", "middle", "last"])
def test_a_permutation_interrupted_at_an_expert_leaves_the_codes_as_they_were(fault, monkeypatch):
    """A permutation's write stopping at the first, a middle or the last expert (the copy interrupted there), both
    ways: the codes go back and the mask still says their layout, so every reader reads what it read before, bit for
    bit (the whole-parameter dequantize, state_dict, the routed dequantize, the fused decode)."""
    from test_moe import base_digest

    model = bf16_moe("builtin:tiny-moe", adapters=False)
    layer = next(m for m in model.modules() if hasattr(m, "experts_fused"))
    every = torch.arange(layer.num_experts)
    at = {"first": 0, "middle": layer.num_experts // 2, "last": layer.num_experts - 1}[fault]
    ids = torch.randint(0, 384, (2, 4), generator=torch.Generator().manual_seed(8))
    digest, whole, blockwise = base_digest(model), layer.gate_up_proj.clone(), experts_gemv.codes(layer, "gate_up_proj")
    blockwise = blockwise.clone()
    with monkeypatch.context() as patched, torch.no_grad():
        dequantize_only(patched)
        decoded = model(input_ids=ids[:, :1]).logits

    def interrupted(action):
        real, armed = torch.Tensor.index_copy_, [True]

        def partial(self, dim, index, source):
            if armed.pop() if armed else False:  # the first write: the experts before `at` written, then a failure
                real(self, dim, index[:at], source[:at])
                raise RuntimeError("injected: the copy stopped at an expert")
            return real(self, dim, index, source)

        with monkeypatch.context() as patched:
            patched.setattr(torch.Tensor, "index_copy_", partial)
            with pytest.raises(RuntimeError, match="injected"):
                action()

    param = layer.parametrizations.gate_up_proj[0]
    interrupted(lambda: experts_gemv.pack(layer, "gate_up_proj", every))
    assert not param.packed.any() and torch.equal(experts_gemv.codes(layer, "gate_up_proj"), blockwise)
    experts_gemv.pack(layer, "gate_up_proj", every)
    kernel = experts_gemv.codes(layer, "gate_up_proj").clone()
    interrupted(lambda: layer.gate_up_proj)  # a whole read: every expert put back blockwise
    assert param.packed.all() and torch.equal(experts_gemv.codes(layer, "gate_up_proj"), kernel)
    with monkeypatch.context() as patched, torch.no_grad():
        dequantize_only(patched)
        assert torch.equal(model(input_ids=ids[:, :1]).logits, decoded)  # (the routed slices read back)
    with torch.no_grad():
        close(model(input_ids=ids[:, :1]).logits, decoded)  # fused, from the kernel's layout
    assert torch.equal(layer.gate_up_proj, whole) and not param.packed.any()
    assert base_digest(model) == digest
