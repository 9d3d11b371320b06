"""Built-in random-weight models of real shapes (models/random_shapes.py): the real config.json's shape, planned without
loading, built from a seed layer by layer with at most one linear layer in 16-bit at a time, refused in one line when
unknown or malformed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from grpo_lab.errors import LabError
from grpo_lab.models.random_shapes import RANDOM_SHAPES
from grpo_lab.models.shapes import load_shape

REAL = {  # from the real models' config.json: vocabulary, hidden, layers, heads, KV heads, intermediate, tied head
    "qwen2.5-7b-random": (152064, 3584, 28, 28, 4, 18944, False),
    "qwen3-8b-random": (151936, 4096, 36, 32, 8, 12288, False),
    "llama3.1-8b-random": (128256, 4096, 32, 32, 8, 14336, False),
    "qwen3-30b-a3b-random": (151936, 2048, 48, 32, 4, 6144, False),  # (its experts: tests/test_moe.py)
}


@pytest.mark.parametrize("name", sorted(RANDOM_SHAPES))
def test_each_shape_is_the_real_models_and_is_planned_without_loading(name):
    shape = load_shape(f"builtin:{name}")
    assert (
        shape.vocab,
        shape.hidden,
        shape.layers,
        shape.heads,
        shape.kv_heads,
        shape.intermediate,
        shape.tied,
    ) == REAL[name]
    assert load_shape(f"builtin:{name}:layers=2").layers == 2


def test_the_plan_of_an_8b_shape_needs_nothing_loaded(capsys):
    from grpo_lab.cli import main

    code = main(
        ["plan", "tiny-cpu", "--set", "model.name_or_path=builtin:qwen3-8b-random", "--set", "placement.learner=cuda:0",
         "--set", "placement.gpu_memory_gib=80", "--set", "generator.backend=synthetic"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "builtin:qwen3-8b-random (8.19B params, nf4)" in out


@pytest.mark.parametrize(
    "name, message",
    [
        ("builtin:qwen9-70b-random", r"unknown built-in shape .*; use one of .*qwen3-8b-random"),
        ("builtin:qwen3-8b-random:layers=0", r"the only option is ':layers=N' with N >= 1"),
        ("builtin:qwen3-8b-random:depth=2", r"has option 'depth=2'"),
        ("builtin:nonesuch", r"unknown built-in model 'builtin:nonesuch'; use one of .*llama3.1-8b-random"),
    ],
)
def test_an_unknown_or_malformed_shape_is_refused_in_one_line(name, message):
    from grpo_lab.models.source import resolve_model_path

    with pytest.raises(LabError, match=message) as err:
        resolve_model_path(name)
    assert "\n" not in str(err.value) and str(err.value).startswith("model.name_or_path: ")


def test_vllm_needs_files_and_is_refused_before_anything_loads(tiny_config):
    from grpo_lab import load_config
    from grpo_lab.preflight import preflight

    cfg = load_config("tiny-cpu", ["model.name_or_path=builtin:qwen3-8b-random:layers=1", "generator.backend=vllm"])
    with pytest.raises(LabError, match=r"^model.name_or_path: .*no checkpoint files, which vLLM's engine \(it loads"):
        preflight(cfg)


BUILD = """
import json, resource, sys, hashlib, torch, psutil
from grpo_lab import load_config
from grpo_lab.models.learner import load_base
cfg = load_config("tiny-cpu", ["model.name_or_path=builtin:llama3.1-8b-random:layers=2", "model.dtype=bfloat16"])
torch.set_num_threads(1)
import bitsandbytes, transformers.models.llama.modeling_llama  # why before `before`: code, not the model's bytes
from grpo_lab.models.random_shapes import random_tokenizer
random_tokenizer()
before = psutil.Process().memory_info().rss
digests, peak = [], None
for _ in range(2):
    model = load_base(cfg.model, "cpu", seed=0)
    if peak is None:  # why here: the hashing below copies tensors to bytes
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode()); h.update(t.detach().contiguous().view(torch.uint8).numpy())  # no bytes copy
    digests.append(h.hexdigest())
    del model
print(json.dumps({"digests": digests, "size": size, "before": before, "peak": peak}))
"""


@pytest.mark.slow
def test_the_builder_is_seeded_and_holds_one_linear_layer_in_16_bit_at_a_time():
    """Built twice in a fresh process: the same bytes; the process's peak RSS above its start is at most the built
    model plus one layer's 16-bit weights (the model built in 16-bit before quantizing would add 2 x 436 MB on this
    2-layer Llama-3.1-8B shape; why 2 layers, not more: the bound is one layer's, and each layer's nf4 quantization
    on the CPU, bitsandbytes' portable path, takes ~7 s)."""
    proc = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["digests"][0] == figures["digests"][1]
    layer_16bit = sum(a * b for a, b in [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096)]) * 2
    layer_16bit += 3 * 4096 * 14336 * 2
    over = figures["peak"] - figures["before"] - figures["size"]
    assert over < layer_16bit, (over / 2**20, layer_16bit / 2**20)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_builder_on_cuda_is_seeded_and_holds_one_linear_layer_in_16_bit_at_a_time():
    from grpo_lab import load_config
    from grpo_lab.models.learner import load_base

    cfg = load_config("tiny-cpu", ["model.name_or_path=builtin:qwen3-8b-random:layers=4", "model.dtype=bfloat16"])
    sums = []
    for _ in range(2):
        torch.cuda.empty_cache()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model = load_base(cfg.model, "cuda:0", seed=0)
        built = torch.cuda.memory_allocated() - start
        over = torch.cuda.max_memory_allocated() - start - built
        sums.append([t.detach().view(torch.uint8).sum().item() for t in model.state_dict().values()])
        del model
        biggest_linear = 12288 * 4096 * 2  # why: one 16-bit linear weight drawn, then quantized
        assert over < 1.5 * biggest_linear, over / 2**20
    assert sums[0] == sums[1]


def test_a_mixture_of_experts_drawn_as_transformers_4bit_load_leaves_it_keeps_its_experts_16_bit():
    """`experts_4bit=False` (TRL's side of the device check, bench/gpu/trl_side.py): nn.Linear in nf4, the fused
    experts in the model's dtype, as transformers' bitsandbytes quantizer leaves them; by default they are nf4 too."""
    from torch.nn.utils import parametrize

    from grpo_lab import load_config
    from grpo_lab.models.learner import quantization_config
    from grpo_lab.models.random_shapes import RandomShape, build_random

    class Small(RandomShape):  # Qwen3-30B-A3B's config.json at a test's size
        def hf_config(self):
            small = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                         head_dim=16, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=512)  # fmt: skip
            return {**RandomShape.hf_config(self), **small}

    shape = Small("qwen3-30b-a3b-random", RANDOM_SHAPES["qwen3-30b-a3b-random"], 1)
    quant = quantization_config(load_config("tiny-cpu").model)
    for experts_4bit in (False, True):
        model = build_random(shape, "cpu", 0, torch.bfloat16, quant, experts_4bit=experts_4bit)
        experts = model.model.layers[0].mlp.experts
        assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
        assert parametrize.is_parametrized(experts, "gate_up_proj") == experts_4bit
        if not experts_4bit:
            assert experts.gate_up_proj.dtype == torch.bfloat16 and experts.gate_up_proj.shape == (8, 64, 64)
