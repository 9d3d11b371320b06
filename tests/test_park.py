"""generator.park_learner (issue 50): while the merged rollout copy decodes, the learner's 4-bit base (codes and quant
state), LoRA and AdamW state wait in host memory and come back bit for bit, also when the rollout raises; the copy
decodes without them (a copy that read a parked tensor would fail on its 0-byte storage); the plan's two lines are the
bytes a real learner parks."""

from __future__ import annotations

import hashlib

import pytest
import torch

from grpo_lab import ConfigError, Lab, load_config
from grpo_lab.models.park import parked, parked_bytes, parked_tensors
from grpo_lab.models.shapes import load_shape
from grpo_lab.planner import plan
from grpo_lab.planner.learner_items import parked_state_bytes

pytestmark = pytest.mark.xdist_group("park")  # why: its tests share one loaded Lab (module-scoped)


def digest(lab) -> str:
    """The learner's whole state, bit for bit: every parameter and buffer (4-bit codes and quant state included) and
    AdamW's state."""
    h = hashlib.sha256()
    model, optimizer = lab.executor.learner.model, lab.executor.learner.optimizer
    tensors = sorted(model.state_dict().items())
    tensors += [(f"adamw.{i}.{k}", v) for i, s in optimizer.state.items() for k, v in s.items() if torch.is_tensor(v)]
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def lab(tiny_model):
    """A float32 Lab after one step (AdamW has state), greedy, 2 prompts x 4, 24 tokens."""
    lab = Lab(
        {
            "model": {"name_or_path": tiny_model, "dtype": "float32", "bnb_4bit_compute_dtype": "float32"},
            "generator": {"max_completion_length": 24, "temperature": 0.0},
            "grpo": {"num_generations": 4, "prompts_per_step": 2, "learning_rate": 0.05},
        }
    ).load()
    lab.step()
    yield lab
    lab.close()


def test_parking_and_unparking_leaves_the_4bit_base_lora_and_adamw_bit_for_bit(lab):
    learner = lab.executor.learner
    tensors = parked_tensors(learner.model, learner.optimizer)
    kinds = {t.dtype for t in tensors}
    assert torch.uint8 in kinds and torch.float32 in kinds  # the 4-bit codes, and LoRA / AdamW / absmax
    assert len(learner.optimizer.state) and all(  # every AdamW moment is among them
        any(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in tensors)
        for s in learner.optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.numel() > 1
    )
    before, expected = digest(lab), parked_bytes(tensors)
    with parked(tensors) as nbytes:
        assert nbytes == expected > 0
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors)  # the learner's own storage is given back
    assert digest(lab) == before


def test_a_failure_inside_a_parked_rollout_puts_the_learner_back_bit_for_bit(lab):
    learner = lab.executor.learner
    tensors = parked_tensors(learner.model, learner.optimizer)
    before = digest(lab)
    with pytest.raises(KeyboardInterrupt):
        with parked(tensors):
            raise KeyboardInterrupt  # Ctrl-C, or an out-of-memory error, in the middle of the decode
    assert digest(lab) == before and all(t.untyped_storage().nbytes() > 0 for t in tensors)


def test_a_parked_merged_rollout_samples_the_learners_greedy_tokens_without_reading_its_state(lab, monkeypatch):
    import grpo_lab.generation.hf as hf

    seen = []
    real = hf.parked

    def watched(tensors):
        seen.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(hf, "parked", watched)
    before = digest(lab)
    out = {}
    for decode, park in (("dynamic", False), ("merged", True)):
        lab.configure({"generator.hf_decode": decode, "generator.park_learner": park})
        torch.manual_seed(0)
        out[decode] = lab.rollout().completion_ids
    assert seen and seen[0] > 0  # the merged rollout ran parked
    assert torch.equal(out["merged"], out["dynamic"])
    assert digest(lab) == before
    lab.configure({"generator.hf_decode": "dynamic", "generator.park_learner": False})


def test_the_plan_parks_what_a_real_learner_parks_on_both_sides(lab):
    config = load_config(lab.config, ["generator.hf_decode=merged", "generator.park_learner=true"])
    planned = parked_state_bytes(load_shape(config.model.name_or_path), config)
    learner = lab.executor.learner
    measured = parked_bytes(parked_tensors(learner.model, learner.optimizer))
    assert 0.95 <= measured / planned <= 1.05, (measured, planned)
    host = plan(config).devices["host"]  # a CPU learner: both lines on the host, so they cancel
    lines = {i.what: i.bytes for i in host.items if i.phase == "rollout"}
    assert lines["learner state parked"] == -lines["parked learner state"] == -planned
    merged = ["generator.hf_decode=merged", "generator.max_completion_length=1024"]
    gpu = plan(load_config("qwen2.5-7b-nf4-24gb", [*merged, "generator.park_learner=true"]))
    unparked = plan(load_config("qwen2.5-7b-nf4-24gb", merged)).devices["cuda:0"]
    card = gpu.devices["cuda:0"]
    assert card.phase_peak("rollout") < unparked.phase_peak("rollout")  # the card holds less while the copy decodes
    assert card.phase_peak("backward") == unparked.phase_peak("backward")  # and the same in every learner phase
    assert gpu.devices["host"].phase_peak("rollout") > gpu.devices["host"].phase_peak("backward")


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_parking_without_the_merged_copy_is_refused_in_one_line(decode):
    with pytest.raises(ConfigError) as caught:
        load_config("tiny-cpu", [f"generator.hf_decode={decode}", "generator.park_learner=true"])
    message = str(caught.value)
    assert "generator.park_learner" in message and "generator.hf_decode: merged" in message and "\n" not in message
