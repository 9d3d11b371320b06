"""Numerics guard: a non-finite loss, gradient norm or updated weight refuses the step (one line naming the
phase and the value, rolled back) instead of writing NaN into the LoRA weights and AdamW's moments."""

import copy
import math

import pytest
import torch

from grpo_lab import LabError


def train_state(lab):
    lora = {n: p.detach().clone() for n, p in lab.learner.model.named_parameters() if p.requires_grad}
    return lora, copy.deepcopy(lab.learner.optimizer.state_dict())


def assert_same_state(lab, before):
    lora, optim = train_state(lab)
    assert all(torch.equal(before[0][n], lora[n]) for n in lora), "LoRA weights changed"
    old, new = before[1]["state"], optim["state"]
    assert old.keys() == new.keys()
    for key in old:
        for name, value in old[key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(new[key][name])), (key, name)


@pytest.fixture
def stepped_lab(loaded_lab):
    """A lab after one good step, so AdamW has moments that NaN could poison."""
    lab = loaded_lab(grpo={"beta": 0.04})
    lab.step()
    return lab


def phases_until_backward(lab):
    rollout = lab.rollout()
    advantages = lab.advantages(lab.rewards(rollout))
    return rollout, advantages, lab.logprobs(rollout)


def test_injected_non_finite_gradient_is_refused_with_state_unchanged(stepped_lab):
    lab = stepped_lab
    before = train_state(lab)
    lab.backward(*phases_until_backward(lab))
    grad = next(p.grad for p in lab.learner.model.parameters() if p.grad is not None)
    grad.view(-1)[0] = math.nan
    with pytest.raises(LabError, match=r"^optimizer: gradient norm is nan at step 1.*refused.*grpo\.") as err:
        lab.optimizer()
    assert "\n" not in str(err.value)
    assert_same_state(lab, before)
    assert all(p.grad is None for p in lab.learner.model.parameters())  # the bad gradients are gone
    assert math.isfinite(lab.step().grad_norm)  # and the lab goes on


def test_non_finite_loss_is_refused_before_backward(stepped_lab):
    lab = stepped_lab
    before = train_state(lab)
    rollout, advantages, logprobs = phases_until_backward(lab)
    advantages.values[0] = math.inf
    with pytest.raises(LabError, match=r"^backward: loss is (nan|inf|-inf) at step 1") as err:
        lab.backward(rollout, advantages, logprobs)
    assert "\n" not in str(err.value)
    assert all(p.grad is None for p in lab.learner.model.parameters())
    assert_same_state(lab, before)


def test_update_to_non_finite_weights_is_rolled_back(stepped_lab):
    lab = stepped_lab
    before = train_state(lab)
    optimizer, real_step = lab.learner.optimizer, lab.learner.optimizer.step

    def overflowing_step(*args, **kwargs):  # an update that overflows (e.g. fp16 moments): finite grads, inf weights
        real_step(*args, **kwargs)
        with torch.no_grad():
            next(p for p in lab.learner.model.parameters() if p.requires_grad).view(-1)[0] = math.inf

    optimizer.step = overflowing_step
    with pytest.raises(LabError, match=r"^optimizer: the update made 1 of \d+ LoRA weights non-finite at step 1"):
        lab.step()
    del optimizer.step
    assert_same_state(lab, before)
    assert math.isfinite(lab.step().loss)


def test_cli_run_stops_with_one_line_on_non_finite_values(tiny_model, tmp_path, capsys, monkeypatch):
    """Through the runner: the step is refused, exit 2, one line; the finished steps stay on disk."""
    from grpo_lab.algo import grpo as step_module
    from grpo_lab.cli import main

    real = step_module.advantages
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        out = real(*args, **kwargs)
        if calls["n"] == 2:
            out.values[:] = math.nan
        return out

    monkeypatch.setattr(step_module, "advantages", poisoned)
    out = tmp_path / "run"
    assert main(["run", "tiny-cpu", "--steps", "3", "--out", str(out), "--quiet"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in err if line.startswith("grpo-lab:")]
    assert errors == [err[-1]] and err[-1].startswith("grpo-lab: error: backward: loss is nan at step 1"), err
    assert "Traceback" not in "\n".join(err)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_diverged_weights_stop_the_rollout_with_one_line():
    """LoRA weights gone to 1e30 (what a learning rate far too high leaves) make sampling see inf/nan probabilities
    (torch.multinomial's RuntimeError): the rollout is refused in one line naming the knobs, nothing of the step is
    kept (no rollout, the weights as they were), and with sane weights back the same step runs."""
    import torch

    from grpo_lab import Lab, LabError

    lab = Lab("tiny-cpu").load()
    try:
        params = lab.learner.trainable_parameters()
        sane = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for name, p in params.items():
                if "lora_B" in name:
                    p.fill_(1e30)
        diverged = {n: p.detach().clone() for n, p in params.items()}
        with pytest.raises(LabError) as err:
            lab.rollout()
        line = str(err.value)
        assert "\n" not in line and "grpo.learning_rate" in line, line
        assert lab.current.rollout is None and lab.step_index == 0 and lab.next_phase() == "rollout"
        assert all(torch.equal(p, diverged[n]) for n, p in params.items())  # the failed phase changed nothing
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(sane[name])
        assert lab.step().attempts == 2  # the refused rollout is filed as a failed attempt of the same step
    finally:
        lab.close()
