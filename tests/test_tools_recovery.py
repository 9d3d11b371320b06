"""A tool-calling run recovers as any run does: an OOM injected in a middle turn (armed by the tool itself, between
the first turn and the second) is one line, nothing of the step is applied, and the Lab steps again bit for bit as a
Lab whose rollout failed in its first turn, before any tool ran, and as a Lab that never failed: the failed turns and
tool calls leave nothing behind (no weights, random draws or loop state)."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from test_tools import call_text, tool_lab

from bench.forced import ForcedTokens
from grpo_lab.errors import LabError

BUDGET = 160  # the forced call and its result take ~118 of tiny-random's tokens: the second turn decodes the rest
ARMED = {"on": False}  # the next call of `add_arming` arms the fault (once)


def add_arming(a: int, b: int) -> int:
    """Add two integers; the first call after ARMED is set arms an OOM in the rollout's next decoding steps.

    Args:
        a: the first
        b: the second
    """
    if ARMED.pop("on", False):
        from grpo_lab.recovery.faults import arm

        arm("rollout", "oom")  # fires at the 3rd decoding step from here: inside the second turn
    return a + b


@pytest.fixture
def first_turn_calls(monkeypatch):
    """Every first turn (a turn given the whole budget) is forced to call the tool, in every rollout: the tiny
    model never writes a call itself."""
    import grpo_lab.generation.hf as hf

    def force(tokenizer, text, budget):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        original = hf.sampling_processors

        def processors(request):
            return original(request) + ([ForcedTokens(ids)] if request.max_completion_length == budget else [])

        monkeypatch.setattr(hf, "sampling_processors", processors)

    return force


def varied(prompts, completions, **kwargs):
    """A reward that differs between completions, so the advantages (and the step's update) are not 0."""
    return [float(len(c[-1]["content"]) % 7) for c in completions]


def trained(lab) -> dict:
    return {n: p.detach().clone() for n, p in lab.learner.trainable_parameters().items()}


def one_step(tiny_config, first_turn_calls, middle: Optional[bool]):
    """(LoRA weights, rewards, turns, attempts) after a tool Lab's step whose first attempt ran out of memory in its
    second turn (`middle`) or in its first; None: a step that never failed."""
    lab = tool_lab(tiny_config, [varied], tools=[add_arming], max_completion_length=BUDGET)
    try:
        first_turn_calls(lab.learner.tokenizer, call_text("add_arming", '{"a": 2, "b": 3}'), budget=BUDGET)
        before = trained(lab)
        if middle is None:
            result = lab.step()
            return trained(lab), result.reward_mean, result.turns_mean, result.attempts
        if middle:
            ARMED["on"] = True
        else:
            lab.arm_fault(0, "rollout", "oom")  # the 3rd decoding step of the first turn
        with pytest.raises(LabError, match=r"out of memory in phase 'rollout'") as err:
            lab.step()
        assert "\n" not in str(err.value) and not ARMED  # (middle: the tool ran, the fault fired after it)
        # named at the turn it failed in, with the knobs that lower a turn's memory (memory/mark_fixes.py)
        assert f"of step 0, at turn {2 if middle else 1} on cpu" in str(err.value), str(err.value)
        assert "generator.max_tool_response_tokens (the tool-result bound)" in str(err.value)
        assert all(torch.equal(p, before[n]) for n, p in trained(lab).items())  # nothing of the step applied
        result = lab.step()
        after = trained(lab)
        assert any(not torch.equal(p, before[n]) for n, p in after.items())  # the retry did update
        return after, result.reward_mean, result.turns_mean, result.attempts
    finally:
        ARMED.clear()
        lab.close()


def test_an_oom_in_a_middle_turn_leaves_the_lab_stepping_again_bit_for_bit(tiny_config, first_turn_calls):
    middle, reward, turns, attempts = one_step(tiny_config, first_turn_calls, middle=True)
    first, first_reward, first_turns, _ = one_step(tiny_config, first_turn_calls, middle=False)
    never, never_reward, never_turns, never_attempts = one_step(tiny_config, first_turn_calls, middle=None)
    assert attempts == 2 and turns == first_turns == never_turns == 2.0  # the retry called the tool, decoded turn 2
    assert reward == first_reward == never_reward and never_attempts == 1
    assert all(torch.equal(p, first[n]) and torch.equal(p, never[n]) for n, p in middle.items())
