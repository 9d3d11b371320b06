"""generator.park_learner (issue 50): while the merged rollout copy decodes, the learner's 4-bit base (codes and quant
state), LoRA and AdamW state wait in host memory and come back bit for bit, also when the rollout raises; the copy
decodes without them (a copy that read a parked tensor would fail on its 0-byte storage); the plan's two lines are the
bytes a real learner parks."""

from __future__ import annotations

import hashlib

import pytest
import torch

from grpo_lab import ConfigError, Lab, load_config
from grpo_lab.models.park import Parking, parked, parked_bytes, parked_tensors, slot_bytes
from grpo_lab.models.shapes import load_shape
from grpo_lab.planner import plan
from grpo_lab.planner.learner_items import parked_state_bytes, parking_buffer_bytes

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
    seen = []
    real = Parking.park

    def watched(self, tensors, reserve=0):
        seen.append(len(tensors))
        return real(self, tensors, reserve)

    monkeypatch.setattr(Parking, "park", watched)
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
    assert 0.99 <= measured / planned <= 1.01, (measured, planned)  # (the quant state's codebooks and AdamW's steps)
    host = plan(config).devices["host"]  # a CPU learner: both lines on the host
    lines = {i.what: i for i in host.items}
    assert lines["learner state parked"].bytes == -planned and lines["learner state parked"].phase == "rollout"
    buffer = lines["parking buffer"]  # kept for the Lab's life: resident, the slots' padding in it
    need = sum(slot_bytes(t) for t in parked_tensors(learner.model, learner.optimizer))
    assert buffer.phase is None and buffer.bytes == parking_buffer_bytes(load_shape(config.model.name_or_path), config)
    assert 1.0 <= buffer.bytes / need <= 1.01, (buffer.bytes, need)
    merged = ["generator.hf_decode=merged", "generator.max_completion_length=1024"]
    gpu = plan(load_config("qwen2.5-7b-nf4-24gb", [*merged, "generator.park_learner=true"]))
    unparked = plan(load_config("qwen2.5-7b-nf4-24gb", merged)).devices["cuda:0"]
    card = gpu.devices["cuda:0"]
    assert card.phase_peak("rollout") < unparked.phase_peak("rollout")  # the card holds less while the copy decodes
    assert card.phase_peak("backward") == unparked.phase_peak("backward")  # and the same in every learner phase
    host_unparked = plan(load_config("qwen2.5-7b-nf4-24gb", merged)).devices["host"]
    assert gpu.devices["host"].resident - host_unparked.resident == parking_buffer_bytes(gpu.shape, gpu.config)


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_parking_without_the_merged_copy_is_refused_in_one_line(decode):
    with pytest.raises(ConfigError) as caught:
        load_config("tiny-cpu", [f"generator.hf_decode={decode}", "generator.park_learner=true"])
    message = str(caught.value)
    assert "generator.park_learner" in message and "generator.hf_decode: merged" in message and "\n" not in message


class Fault:
    """Raise `error` at the `at`-th call of a Parking copy (0-based; -1: the last of `count`), once."""

    def __init__(self, real, at: int, count: int, error: BaseException):
        self.real, self.at, self.calls, self.error = real, at if at >= 0 else count + at, 0, error

    def __call__(self, *args):
        self.calls += 1
        if self.calls - 1 == self.at:
            raise self.error
        return self.real(*args)


OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")


@pytest.mark.parametrize("at", [0, "middle", -1])
@pytest.mark.parametrize("error", [OOM, KeyboardInterrupt()], ids=["oom", "ctrl-c"])
def test_an_error_at_any_tensor_while_putting_the_learner_back_loses_nothing_and_the_lab_steps_again(
    lab, monkeypatch, at, error
):
    """The learner's host copies are held until every tensor is back: an out-of-memory error or Ctrl-C at the first,
    a middle or the last tensor of the put-back leaves it held; the Lab's next command puts it back, bit for bit, and
    steps. (With the copies dropped as the put-back raised, the next step read empty tensors: a crash.)"""
    learner = lab.executor.learner
    count = len(parked_tensors(learner.model, learner.optimizer))
    index = count // 2 if at == "middle" else at % count
    lab.configure({"generator.hf_decode": "merged", "generator.park_learner": True})
    try:
        before = digest(lab)
        fault = Fault(Parking.to_device, index, count, error)
        monkeypatch.setattr(Parking, "to_device", staticmethod(fault))
        monkeypatch.setattr(  # why: the failed phase's own retry (LocalExecutor.failed) must fail too, to leave it held
            "grpo_lab.execution.local.put_back", lambda parking, device: None
        )
        with pytest.raises((type(error), Exception)) as caught:
            lab.rollout()
        assert isinstance(caught.value, KeyboardInterrupt) or "out of memory" in str(caught.value)
        parking = lab.executor.generator.parking
        assert fault.calls == index + 1 and parking.pending == count - index  # the rest wait, held
        address = parking.buffer.tensor.data_ptr()  # (the rest wait in its slots)
        monkeypatch.undo()
        lab.configure({"generator.hf_decode": "merged", "generator.park_learner": True})
        rollout = lab.rollout()  # the next command puts the learner back first, then runs
        assert parking.pending == 0 and len(rollout) > 0
        assert parking.buffer.tensor.data_ptr() == address  # parked again into the same buffer
        lab.rollback()
        assert digest(lab) == before
    finally:
        lab.configure({"generator.hf_decode": "dynamic", "generator.park_learner": False})


@pytest.mark.parametrize("at", [0, "middle", -1])
def test_an_error_at_any_tensor_while_parking_puts_back_what_was_parked_at_once(lab, monkeypatch, at):
    learner = lab.executor.learner
    tensors = parked_tensors(learner.model, learner.optimizer)
    index = len(tensors) // 2 if at == "middle" else at
    before = digest(lab)
    monkeypatch.setattr(Parking, "to_host", staticmethod(Fault(Parking.to_host, index, len(tensors), OOM)))
    parking = Parking()
    with pytest.raises(torch.OutOfMemoryError):
        with parked(tensors, parking):
            pytest.fail("the block must not run when parking failed")
    assert parking.pending == 0 and digest(lab) == before
    assert all(t.untyped_storage().nbytes() > 0 for t in tensors)


def test_the_copy_is_released_before_the_learner_comes_back(lab, monkeypatch):
    """Why: at 8B the copy is 13-16 GiB; putting the learner back beside it is a moment no plan line covers."""
    copy = lab.executor.generator.rollout_copy
    held_at_put_back = []
    real = Parking.put_back

    def watched(self):
        if self.pending:
            held_at_put_back.append(copy.held_bytes())
        return real(self)

    monkeypatch.setattr(Parking, "put_back", watched)
    # (a kept copy stays beside the learner: the plan holds it resident, tests/test_kept_copy.py)
    lab.configure(
        {"generator.hf_decode": "merged", "generator.park_learner": True, "generator.rollout_copy": "release"}
    )
    try:
        lab.rollout()
    finally:
        lab.configure(
            {"generator.hf_decode": "dynamic", "generator.park_learner": False, "generator.rollout_copy": "auto"}
        )
    assert held_at_put_back == [0]  # the copy's weights were already released


def test_parking_fills_one_host_buffer_sized_from_the_plan_and_reused_at_every_rollout(tiny_model, monkeypatch):
    """A fresh Lab: its first rollout parks no AdamW state (none yet), the later ones do; the buffer, sized from the
    plan, is made once, at one address for every rollout, and each parked tensor's values are a view of it (so no
    host tensor of their own); the learner comes back bit for bit each time. On the CPU it is a plain buffer (pinning
    needs CUDA): the same code path."""
    lab = Lab(
        {
            "model": {"name_or_path": tiny_model, "dtype": "float32", "bnb_4bit_compute_dtype": "float32"},
            "generator": {"max_completion_length": 8, "hf_decode": "merged", "park_learner": True},
            "grpo": {"num_generations": 4, "prompts_per_step": 2, "learning_rate": 0.05},
        }
    ).load()
    try:
        parking = lab.executor.generator.parking
        seen, real = [], Parking.park

        def watched(self, tensors, reserve=0):
            out = real(self, tensors, reserve)
            buffer = self.buffer.tensor
            inside = all(h.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for _, h in self.held)
            seen.append((len(tensors), buffer.data_ptr(), buffer.numel(), inside, digest_of(tensors, self)))
            return out

        monkeypatch.setattr(Parking, "park", watched)
        before = []
        for _ in range(3):
            before.append(digest(lab))
            result = lab.step()
            assert result.attempts == 1
        counts, addresses, sizes, inside, _ = zip(*seen)
        assert counts[0] < counts[1] == counts[2]  # AdamW's state appears after the first update
        assert len(set(addresses)) == 1 and len(set(sizes)) == 1 and all(inside)  # one buffer, every rollout
        assert parking.buffer.made == 1  # (an address alone could repeat: the allocator may hand a freed one back)
        config = lab.config
        assert sizes[0] == int(parking_buffer_bytes(load_shape(config.model.name_or_path), config))
        assert parking.pending == 0 and not parking.held
    finally:
        lab.close()


def digest_of(tensors, parking) -> str:
    """The parked values as the buffer holds them (each slot's bytes, in order)."""
    h = hashlib.sha256()
    for _, host in parking.held:
        h.update(host.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_parking_copies_the_same_bytes_into_the_buffer_and_back(lab):
    """Each slot holds its tensor's bytes exactly while parked, and the tensor gets them back: through the buffer,
    also for a 0-dim AdamW step and the uint8 4-bit codes beside float32 (each slot aligned for its dtype)."""
    learner = lab.executor.learner
    tensors = parked_tensors(learner.model, learner.optimizer)
    values = [t.detach().clone() for t in tensors]
    parking = Parking()
    assert {t.dim() for t in tensors} >= {0, 1, 2} and {t.dtype for t in tensors} >= {torch.uint8, torch.float32}
    with parked(tensors, parking):
        assert all(torch.equal(host, v) for (_, host), v in zip(parking.held, values))
        assert all(host.data_ptr() % host.element_size() == 0 for _, host in parking.held)
    assert all(torch.equal(t, v) for t, v in zip(tensors, values))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
def test_on_a_gpu_the_parking_buffer_is_pinned_made_once_and_the_learner_comes_back_bit_for_bit(tiny_model):
    """The GPU path the CPU cannot run: the one buffer registered as pinned (cudaHostRegister), its non-blocking copies
    awaited before any storage is given back, at one address for every rollout, the learner back bit for bit."""
    lab = Lab(
        {
            "model": {"name_or_path": tiny_model, "dtype": "float32", "bnb_4bit_compute_dtype": "float32"},
            "placement": {"learner": "cuda:0"},
            "generator": {"max_completion_length": 8, "hf_decode": "merged", "park_learner": True},
            "grpo": {"num_generations": 4, "prompts_per_step": 2, "learning_rate": 0.05},
        }
    ).load()
    try:
        parking, addresses = lab.executor.generator.parking, []
        for _ in range(3):
            lab.step()
            addresses.append(parking.buffer.tensor.data_ptr())
            assert parking.buffer.pinned and parking.buffer.tensor.is_pinned()
        assert len(set(addresses)) == 1 and parking.buffer.made == 1
        before = digest(lab)
        lab.rollout()
        lab.rollback()
        assert digest(lab) == before
    finally:
        lab.close()
