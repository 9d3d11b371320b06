"""A failed phase is undone with the random draws it made: the retry samples and trains bit for bit as a Lab that
never failed. A rollout draws its rows' seeds from torch's generator before it decodes (generation/base.row_seeds), and
a backward with LoRA dropout draws its masks, so a failure after those draws left the retry on other streams: other
tokens, another update (recovery/streams.py puts them back). Two Labs on tiny-random, the same config and seed,
sampled at temperature 1: one fails once, the other just steps; their rollouts and LoRA weights are compared."""

from __future__ import annotations

import pytest
import torch
from test_numerics import assert_same_state, train_state

from grpo_lab import LabError
from grpo_lab.errors import NonFinite

# lora_dropout: the learner's RNG user; num_iterations 2: a failure can come after an applied update
SECTIONS = dict(lora={"lora_dropout": 0.1}, grpo={"num_iterations": 2, "learning_rate": 5e-3})


def rest_of_step(lab) -> dict:
    """The rest of the current step, a phase at a time: what each phase returned last, by name."""
    out = {}
    while True:
        name, value = lab.run_next_phase()
        out[name] = value
        if name == "sync":
            return out


def assert_same_rollout(got, expected) -> None:
    assert got.batch.prompts == expected.batch.prompts
    assert torch.equal(got.completion_ids, expected.completion_ids)
    assert torch.equal(got.completion_mask, expected.completion_mask)
    assert torch.equal(got.sampler_logprobs, expected.sampler_logprobs)


def fault(phase: str, error: str):
    """Arm `phase` of the next Lab phase to fail once with `error` (recovery/faults.py)."""
    return lambda lab, monkeypatch: lab.arm_fault(0, phase, error)


def second_backward(lab, monkeypatch) -> None:
    """The step's second backward fails after its work (its dropout drawn, one update applied): the undo rolls the
    update back, and the retry starts at the step's first backward."""
    import grpo_lab.algo.grpo as step_module

    real, calls = step_module.backward, []

    def failing(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out)
        if len(calls) == 2:
            monkeypatch.undo()
            raise RuntimeError("injected failure in backward")
        return out

    monkeypatch.setattr(step_module, "backward", failing)


@pytest.mark.parametrize(
    "fail, raised",
    [
        (fault("rollout", "oom"), LabError),  # the third decoding step: every row's seed is drawn
        (fault("backward", "nan"), NonFinite),  # the first micro-batch's loss: its forward drew the dropout masks
        (second_backward, RuntimeError),  # the retry starts before the failed phase: at the step's first backward
    ],
    ids=["rollout", "backward", "second-backward"],
)
def test_a_failed_phase_leaves_the_random_streams_as_a_lab_that_never_failed(loaded_lab, monkeypatch, fail, raised):
    lab, twin = loaded_lab(**SECTIONS), loaded_lab(**SECTIONS)
    try:
        fail(lab, monkeypatch)
        with pytest.raises(raised, match="rollout|backward"):
            lab.step()
        assert lab.next_phase() in ("rollout", "backward") and lab.current.updates == 0  # undone
        rollout = lab.current.rollout  # (a failed backward's step keeps its rollout; a failed rollout has none)
        for step in range(2):  # the retried step, and the one after it (its seeds come from the streams the retry left)
            got, expected = rest_of_step(lab), rest_of_step(twin)
            assert_same_rollout(got.get("rollout", rollout), expected["rollout"])
            assert_same_state(lab, train_state(twin))
            assert got["sync"].loss == expected["sync"].loss, step
        assert lab.history[0].attempts == 2 and twin.history[0].attempts == 1
    finally:
        lab.close(), twin.close()


def test_a_rollback_by_hand_redoes_the_steps_backward_with_its_first_dropout_masks(loaded_lab):
    """lab.rollback() undoes the step's updates and goes on from backward: the redone backward draws the dropout masks
    the first drew (a Lab that never rolled back trains the same), as a failed phase's retry does."""
    lab, twin = loaded_lab(**SECTIONS), loaded_lab(**SECTIONS)
    try:
        while lab.next_phase() != "sync":  # through both backwards and updates: every dropout mask drawn
            lab.run_next_phase()
        lab.rollback()
        assert lab.next_phase() == "backward" and lab.current.updates == 0
        got, expected = rest_of_step(lab), rest_of_step(twin)
        assert_same_state(lab, train_state(twin))
        assert got["sync"].loss == expected["sync"].loss
    finally:
        lab.close(), twin.close()
