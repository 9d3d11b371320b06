"""A 16-bit learner on a GPU runs its forward passes under torch.autocast, as TRL's do under accelerate's mixed
precision (issue 33: on an H100 grpo_lab's backward peak was 1.20x TRL's at 1,024 tokens). Without it, PEFT casts
every LoRA layer's input to the adapters' float32 and backward keeps each copy. PEFT asks autocast's state with
`torch.is_autocast_enabled()`, which reads CUDA's; the CPU tests below make that call read the CPU's, so the GPU's
mechanism runs here at the same point."""

from __future__ import annotations

import pytest
import torch

from grpo_lab import load_config
from grpo_lab.algo.logprobs import completion_logprobs, precision
from grpo_lab.models.learner import autocast_dtype, load_learner


@pytest.mark.parametrize(
    "sets, device, expected",
    [
        ({"model.bnb_4bit_compute_dtype": "bfloat16"}, "cuda:0", torch.bfloat16),  # nf4 computing in bfloat16
        ({"model.bnb_4bit_compute_dtype": "float16"}, "cuda:1", torch.float16),
        ({"model.bnb_4bit_compute_dtype": "float32", "model.dtype": "bfloat16"}, "cuda:0", None),
        ({"model.load_in_4bit": "false", "model.dtype": "bfloat16"}, "cuda:0", torch.bfloat16),
        ({"model.load_in_4bit": "false", "model.dtype": "float32"}, "cuda:0", None),
        ({"model.bnb_4bit_compute_dtype": "bfloat16"}, "cpu", None),  # PEFT upcasts on the CPU whatever autocast says
    ],
)
def test_the_learner_autocasts_at_its_16_bit_compute_dtype_on_a_gpu_only(sets, device, expected):
    cfg = load_config("tiny-cpu", [f"{k}={v}" for k, v in sets.items()])
    assert autocast_dtype(cfg.model, device) is expected


@pytest.fixture
def peft_reads_the_cpus_autocast(monkeypatch):
    real = torch.is_autocast_enabled
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: real(device_type or "cpu"))


def batch(learner, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 250, (4, 12), generator=g)
    completions = torch.randint(3, 250, (4, 20), generator=g)
    completion_mask = (torch.arange(20) < torch.tensor([[20], [13], [7], [16]])).long()  # varied lengths
    return prompts, torch.ones_like(prompts), completions, completion_mask


def saved_bytes(model, rows) -> tuple[int, torch.Tensor]:
    """Bytes autograd keeps for backward during one scoring pass with grad, and the pass's log-probs."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs = completion_logprobs(model, *rows)
    logprobs.sum().backward()
    return total[0], logprobs.detach()


def test_autocast_keeps_no_float32_copy_of_each_lora_input(tiny_model, peft_reads_the_cpus_autocast):
    sets = [
        f"model.name_or_path={tiny_model}",
        "model.dtype=bfloat16",
        "model.bnb_4bit_compute_dtype=bfloat16",
        "model.gradient_checkpointing=false",  # why: checkpointing's own hooks would hide the layers' saved tensors
        "lora.target_modules=all-linear",
    ]
    learner = load_learner(load_config("tiny-cpu", sets))
    base = learner.model.get_base_model()
    rows = batch(learner)
    assert base._grpo_lab_autocast is None  # a CPU learner: none
    plain, plain_lp = saved_bytes(learner.model, rows)
    base._grpo_lab_autocast = torch.bfloat16  # what a GPU learner gets (autocast_dtype)
    cast, cast_lp = saved_bytes(learner.model, rows)
    # every LoRA layer's input saved in 16 bits, not upcast: on the tiny body 0.77x the bytes
    assert cast < 0.85 * plain, (cast, plain)
    # the same policy scored: autocast changes the arithmetic's rounding only
    assert torch.allclose(cast_lp, plain_lp, atol=0.1), (cast_lp - plain_lp).abs().max()


def test_the_rollout_and_the_backbone_run_under_autocast_and_the_head_does_not(tiny_model):
    learner = load_learner(load_config("tiny-cpu", [f"model.name_or_path={tiny_model}"]))
    base = learner.model.get_base_model()
    base._grpo_lab_autocast = torch.bfloat16
    seen = {}

    def record(name):
        def hook(*_):
            seen.setdefault(name, torch.is_autocast_enabled("cpu"))

        return hook

    getattr(base, base.base_model_prefix).layers[0].register_forward_pre_hook(record("layer"))
    base.get_output_embeddings().register_forward_pre_hook(record("head_in_generate"))
    with torch.no_grad():
        completion_logprobs(learner.model, *batch(learner))
    assert seen == {"layer": True}  # the chunked head reads the weight itself, outside autocast
    seen.clear()
    with precision(learner.model):  # what generation/hf.py wraps generate() in
        learner.model.generate(input_ids=batch(learner)[0][:1], max_new_tokens=2, do_sample=False)
    assert seen == {"layer": True, "head_in_generate": True}
    base._grpo_lab_autocast = None
    with precision(learner.model):
        assert not torch.is_autocast_enabled("cpu")
