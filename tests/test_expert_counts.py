"""A phase's count of the 4-bit experts it dequantized (execution/expert_counts.py) reads the experts modules found
once a model (models/experts_found.py): a dense model's phase walks none of its modules, a mixture of experts'
phase counts what its forward dequantized, and a module tree that changed is searched again."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo_lab.execution.expert_counts import counted

pytestmark = pytest.mark.xdist_group("moe")


def learner(name: str, lora: bool = False):
    from grpo_lab import load_config
    from grpo_lab.models.learner import add_lora, load_base

    knobs = ["model.dtype=float32", "model.bnb_4bit_compute_dtype=float32"]
    config = load_config("tiny-cpu", [f"model.name_or_path={name}", *knobs])
    model = load_base(config.model, "cpu")
    return add_lora(model, config) if lora else model


def forward(ex, state):
    with torch.no_grad():
        ex.learner.model(input_ids=torch.tensor([[5, 7]]))
    return SimpleNamespace(experts=None)


def phase(model):
    """counted around a no-gradient forward of `model`, its count given back."""
    run = counted(forward, lambda out, experts: setattr(out, "experts", experts))
    return run(SimpleNamespace(learner=SimpleNamespace(model=model)), None).experts


def test_a_dense_models_phase_walks_none_of_its_modules(tiny_model, monkeypatch):
    model = learner(str(tiny_model), lora=True)  # (the suite's dense model in PEFT's wrapper, as a learner's model is)
    assert phase(model) == 0  # (the first phase finds the model's experts modules: none)
    walks = []
    named = torch.nn.Module.named_modules

    def counting(self, *args, **kwargs):
        walks.append(type(self).__name__)
        return named(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "named_modules", counting)  # (modules() reads it too)
    assert [phase(model) for _ in range(3)] == [0, 0, 0]
    assert walks == []


def test_a_mixture_of_experts_phase_counts_what_it_dequantized_and_a_changed_tree_is_searched_again(monkeypatch):
    from grpo_lab.models import held_experts

    monkeypatch.setattr(held_experts, "HELD_BYTES", -1)  # (the routed dequantize: a count per token's top-2)
    model = learner("builtin:tiny-moe")
    routed = []  # each router call's distinct experts: what the routed dequantize reads
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, i, out: routed.append(out[2].unique().numel()))
    assert phase(model) == sum(routed) > 0
    extra = torch.nn.Linear(1, 1)
    extra.experts_dequantized = 0
    model.extra = extra  # a module registered in the tree after its experts were found
    run = counted(lambda ex, state: extra.__setattr__("experts_dequantized", 3) or SimpleNamespace(), setattr_count)
    assert run(SimpleNamespace(learner=SimpleNamespace(model=model)), None).experts == 3


def setattr_count(out, experts: int) -> None:
    out.experts = experts
