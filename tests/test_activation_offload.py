"""Activation offload (`model.activation_offload`, models/activation_offload.py): the step's loss and LoRA gradients
are those of plain checkpointing, its layer inputs really go through the host copies, and a knob it cannot serve is
refused in one line."""

from __future__ import annotations

import pytest
import torch

from grpo_lab import Lab
from grpo_lab.errors import ConfigError


def backward_of_one_step(config: dict) -> tuple[float, dict]:
    """The first step's loss and every LoRA gradient, read after its backward phase (before the optimizer uses them).
    Dropout on LoRA's input, so a recompute that draws another mask than the forward did shows too."""
    lab = Lab(config).load()
    try:
        while lab.next_phase() != "optimizer":
            name, out = lab.run_next_phase()
            if name == "backward":
                loss = out.loss
        grads = {n: p.grad.clone() for n, p in lab.learner.model.named_parameters() if p.requires_grad}
        return loss, grads
    finally:
        lab.close()


def test_offload_gives_the_plain_checkpointed_loss_and_gradients(tiny_config):
    """Off-policy (two iterations: old log-probs differ from the policy's after the first update) would need a
    second step; one step with varied completion lengths, dropout and micro-batches of 3 already exercises the
    recompute order, the RNG and the per-layer inputs."""
    sections = dict(
        lora={"r": 8, "lora_alpha": 16, "lora_dropout": 0.1},
        grpo={"num_generations": 4, "prompts_per_step": 2, "micro_batch_size": 3, "learning_rate": 1e-3},
    )
    plain_loss, plain = backward_of_one_step(tiny_config(**sections))
    offload_config = tiny_config(**sections)
    offload_config["model"]["activation_offload"] = True
    loss, grads = backward_of_one_step(offload_config)
    assert loss == pytest.approx(plain_loss, rel=1e-6, abs=1e-7)
    assert grads.keys() == plain.keys() and len(grads) > 0
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[name], rtol=1e-5, atol=1e-7, msg=name)
    assert any(g.abs().sum() > 0 for g in grads.values())


def test_each_layer_recomputes_from_its_own_host_copy(tiny_config, monkeypatch):
    """The inputs travel through the host copies: with every copy brought back zeroed, the gradients change (so the
    equality above is not plain checkpointing running beside an unused copy)."""
    from grpo_lab.models import activation_offload

    config = tiny_config()
    config["model"]["activation_offload"] = True
    _, honest = backward_of_one_step(config)
    real = activation_offload.ActivationOffload.to_device
    monkeypatch.setattr(activation_offload.ActivationOffload, "to_device", lambda self, h: real(self, h) * 0)
    _, zeroed = backward_of_one_step(config)
    assert any(not torch.equal(zeroed[n], honest[n]) for n in honest)


def test_offload_holds_each_layers_input_until_backward():
    """On a module stack: one host copy per layer during forward, all used and released by backward."""
    from grpo_lab.models.activation_offload import ActivationOffload

    offload = ActivationOffload("cpu")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(3)]
    x = torch.randn(4, 8)
    h = x
    for layer in layers:
        h = offload(lambda t, layer=layer: torch.tanh(layer(t)), h)
    assert len([r for r in offload.waiting if r() is not None]) == 3
    assert offload.offloaded_bytes == 3 * x.numel() * 4
    h.sum().backward()
    assert not [r for r in offload.waiting if r() is not None]
    offloaded = [layer.weight.grad.clone() for layer in layers]
    for layer in layers:
        layer.weight.grad = None
    h = x
    for layer in layers:
        h = torch.tanh(layer(h))
    h.sum().backward()
    for layer, grad in zip(layers, offloaded):
        torch.testing.assert_close(grad, layer.weight.grad)


def test_offload_without_checkpointing_is_refused_in_one_line(tiny_config):
    config = tiny_config(model={"activation_offload": True, "gradient_checkpointing": False})
    with pytest.raises(ConfigError) as err:
        Lab(config)
    assert "activation_offload" in str(err.value) and "gradient_checkpointing: true" in str(err.value)
    assert "\n" not in str(err.value)


def _stack_grads(offload, device: str, dtype) -> list:
    """Gradients of a 6-layer MLP stack's weights, each layer through `offload` (None: plain autograd)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(512, 512).to(device, dtype) for _ in range(6)]
    h = torch.randn(2048, 512, device=device, dtype=dtype)
    for layer in layers:
        fn = lambda t, layer=layer: torch.nn.functional.gelu(layer(t))  # noqa: E731
        h = fn(h) if offload is None else offload(fn, h)
    h.float().square().mean().backward()
    return [layer.weight.grad for layer in layers]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_on_cuda_copies_on_a_side_stream_and_gives_the_plain_gradients():
    """The CUDA path: pinned host copies on the side stream, a prefetch one layer ahead, the inputs' blocks kept until
    their copies are done (record_stream): the gradients equal plain autograd's, and the GPU held fewer inputs."""
    from grpo_lab.models.activation_offload import ActivationOffload

    plain = _stack_grads(None, "cuda", torch.bfloat16)
    offload = ActivationOffload("cuda:0")
    offloaded = _stack_grads(offload, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    for a, b in zip(offloaded, plain):
        torch.testing.assert_close(a, b)
    assert offload.offloaded_bytes == 6 * 2048 * 512 * 2
    assert not [r for r in offload.waiting if r() is not None]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_cuda_expandable_segments_takes_effect_at_load():
    """The knob works: after a CUDA learner loads with it on (the default), a new allocation is an expandable
    segment; PYTORCH_CUDA_ALLOC_CONF naming it is left alone (the function says so)."""
    import os

    from grpo_lab.runtime import expandable_segments

    if "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        assert expandable_segments(True) is False
        return
    assert expandable_segments(True) is True
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    segments = torch.cuda.memory_snapshot()
    assert any(s.get("is_expandable") for s in segments), [s.keys() for s in segments][:1]
    del x


def test_offload_the_host_cannot_hold_is_refused_before_loading():
    """Qwen3-8B's shape at 128K tokens offloads 36 x 128K x 4096 x 2 bytes (36 GiB) of layer inputs: more than this
    host may hold under memory.host_threshold, so preflight refuses it, naming the field and the bytes."""
    from grpo_lab import load_config
    from grpo_lab.errors import LabError
    from grpo_lab.preflight import check_offload_host, preflight

    overrides = [
        "model.name_or_path=builtin:qwen3-8b-random",
        "model.activation_offload=true",
        "placement.learner=cuda:0",
        "placement.gpu_memory_gib=141",
        "generator.backend=synthetic",
        "generator.max_completion_length=131072",
        "grpo.micro_batch_size=1",
        "placement.host_memory_gib=32",
        "model.dtype=bfloat16",
        "model.bnb_4bit_compute_dtype=bfloat16",
    ]
    with pytest.raises(LabError) as err:
        preflight(load_config("tiny-cpu", overrides))
    message = str(err.value)
    assert message.startswith("model.activation_offload: the offloaded layer inputs need 36.") and "\n" not in message
    assert "memory.host_threshold" in message
    # 4K tokens offload 1.1 GiB: accepted (the devices' checks after it are another test's)
    shorter = overrides[:5] + ["generator.max_completion_length=4096", *overrides[6:]]
    check_offload_host(load_config("tiny-cpu", shorter))


def test_the_worst_case_probe_runs_with_offload_on(tiny_config):
    """The probe (full-length completions, every micro-batch full) with activation offload on: it fits, measured beside
    the plan, and its backward went through the host copies."""
    config = tiny_config(
        model={"activation_offload": True},
        generator={"max_completion_length": 48},
        grpo={"num_generations": 4, "prompts_per_step": 2, "micro_batch_size": 2},
    )
    lab = Lab(config).load()
    try:
        report = lab.probe()
        assert report.fits, report.verdict
        assert report.completion_tokens == 48
        assert report.measured("host", "backward") and report.planned["host"]["backward"]
        offload = lab.learner.model.grpo_lab_activation_offload
        assert offload.offloaded_bytes >= 2 * (report.prompt_tokens + 48) * 2 * 128 * 4  # 2 rows x 2 layers, float32
    finally:
        lab.close()
