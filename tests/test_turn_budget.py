"""A turn that crosses a host budget (issue 69, item 5): a tool whose answers grow pushes a tool loop's rollout over
its line at turn 3. The live guard stops the rollout there, in one line that names the turn and the knobs that lower
a multi-turn rollout's memory; the step is undone bit for bit (LoRA weights, AdamW state, data position); the fix, the
tool-result bound, runs the rollout again (the tool is called again: nothing of the stopped rollout is kept) under
the same line, and the step completes. The model's calls are forced (the random model never writes one); its memory
is real: `builtin:kv-heavy` keeps 32 KiB of KV cache a token."""

from __future__ import annotations

import pytest
import torch
from test_tools import TEMPLATE, call_text

from bench.forced import ForcedTokens
from grpo_lab import Lab
from grpo_lab.memory.readers import MiB
from grpo_lab.memory.sampler import HostMemoryExceeded

CALLS = 2  # the rounds of calls: turns 1 and 2 call, turn 3 reads the second round's answers
BOUND = 16  # the fix: generator.max_tool_response_tokens
# what the line's fix names: the rows in flight, the turns, the tool-result bound, the trajectory budget
KNOBS = [
    "generator.chunk_size",
    "generator.max_tool_calling_iterations",
    "generator.max_tool_response_tokens",
    "generator.max_completion_length",
]
LINE_ABOVE_MIB = 128  # the line, this far above the bounded step's peak: the unbounded turn 3 holds ~150 MiB more KV


def growing():
    """A tool whose answers grow: its n-th call answers with 2**(n+1) words (4 rows: 4-32 words in the first round of
    calls, 64-512 in the second)."""
    answered = []

    def lookup(x: int) -> str:
        """Look a number up.

        Args:
            x: the number
        """
        answered.append(x)
        return " ".join(["7"] * 2 ** (len(answered) + 1))

    lookup.answered = answered
    return lookup


@pytest.fixture
def forced(monkeypatch):
    """Turns 1 and 2 of every rollout write the call; turn 3 ends at once (its memory is its prefill: the answers)."""
    import grpo_lab.generation.hf as hf

    original, made = hf.sampling_processors, []

    def install(tokenizer):
        call = tokenizer(call_text("lookup", '{"x": 7}'), add_special_tokens=False)["input_ids"]
        stop = tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]

        def processors(request):
            made.append(request)
            return original(request) + [ForcedTokens(call if (len(made) - 1) % (CALLS + 1) < CALLS else stop)]

        monkeypatch.setattr(hf, "sampling_processors", processors)

    return install


def state(lab) -> dict:
    """LoRA weights, AdamW tensors and the data position, cloned (the undone rollout's random draws are not put back:
    its retry samples afresh, as any failed rollout's does)."""
    lora = {n: p.detach().clone() for n, p in lab.learner.trainable_parameters().items()}
    adam = {
        f"{i}.{k}": v.detach().clone()
        for i, s in enumerate(lab.learner.optimizer.state.values())
        for k, v in s.items()
        if torch.is_tensor(v)
    }
    return {"lora": lora, "adam": adam, "data": lab.prompts.state_dict()}


def assert_same(a: dict, b: dict) -> None:
    for part in ("lora", "adam"):
        assert a[part].keys() == b[part].keys() and a[part], part
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert a["data"] == b["data"]


def peak_rss(lab, step: int) -> float:
    """The highest RSS of `step`'s phases (its completed attempt), in bytes."""
    return max(r["peak"] for r in lab.memory.rows_for(step) if r["device"] == "host" and r["metric"] == "rss")


@pytest.mark.slow
def test_a_turn_that_crosses_the_budget_is_stopped_there_undone_and_the_bound_runs_under_it(tiny_config, forced):
    tool = growing()
    cfg = tiny_config(
        model={"name_or_path": "builtin:kv-heavy", "chat_template": TEMPLATE, "gradient_checkpointing": True},
        generator={
            "max_completion_length": 1400,
            "max_prompt_length": 640,
            "max_tool_calling_iterations": CALLS,
            "max_tool_response_tokens": BOUND,
        },  # fmt: skip
        # why one row a micro-batch: the rollout's rows in flight, not the training passes, are the step's peak
        grpo={"beta": 0.0, "num_generations": 2, "prompts_per_step": 2, "micro_batch_size": 1},
        data={"system_prompt": None},
    )
    lab = Lab(cfg, reward_funcs=["length"], tools=[tool]).load()
    try:
        forced(lab.learner.tokenizer)
        lab.step()  # bounded: AdamW has state, and the step's peak is known
        # the line, LINE_ABOVE_MIB above the bounded step's peak (placement.host_memory_gib, as its reader holds it)
        line = peak_rss(lab, 0) + LINE_ABOVE_MIB * MiB
        before, reader = state(lab), lab.memory.readers[0]
        reader.budget = line / lab.memory.host_threshold
        lab.configure(generator={"max_tool_response_tokens": None})  # the answers reach the model whole
        tool.answered.clear()  # (its answers grow from the rollout's first call)
        with pytest.raises(HostMemoryExceeded) as caught:
            lab.step()
        message = str(caught.value)
        # stopped at turn 3, in one line naming the turn and the knobs that lower a multi-turn rollout's memory
        assert (
            "\n" not in message and "during phase 'rollout' of step 1, at turn 3, no update had been applied" in message
        )
        assert caught.value.mark == "turn 3"
        for knob in KNOBS:
            assert knob in caught.value.fix, knob
        marks = [(m["mark"], m["failed_attempt"] is not None) for m in lab.memory.segments if m["step"] == 1]
        assert marks == [(m, True) for m in ("turn 1", "tools 1", "turn 2", "tools 2", "turn 3")], marks  # filed
        assert len(tool.answered) == 2 * CALLS * 2  # every row called in both rounds: the second's answers crossed
        # undone bit for bit: the step starts again from its rollout
        assert_same(before, state(lab))
        assert lab.step_index == 1 and lab.next_phase() == "rollout"
        # the fix, the tool-result bound, under the same line: the rollout runs again (its tools are called again,
        # nothing of the stopped one is kept) and the step completes
        lab.configure(generator={"max_tool_response_tokens": BOUND})
        result = lab.step()
        assert result.step == 1 and len(tool.answered) == 2 * (2 * CALLS * 2)
        assert reader.budget == line / lab.memory.host_threshold and peak_rss(lab, 1) < line
        done = [m["mark"] for m in lab.memory.segments if m["step"] == 1 and m["failed_attempt"] is None]
        assert done == ["turn 1", "tools 1", "turn 2", "tools 2", "turn 3"], done
    finally:
        lab.close()


class SteppedHost:
    """A host reader whose used memory is set by the test (a fraction of its 1 GiB limit)."""

    device, budget = "host", None

    def __init__(self):
        self.used = 0.5

    def read(self) -> dict:
        return {"rss": self.used * 1024 * MiB, "used": self.used * 1024 * MiB, "limit": 1024 * MiB}


def test_a_phase_that_ran_to_its_end_is_vetoed_at_the_mark_of_its_peak():
    """Without the live guard, the after-phase veto names the mark whose peak crossed (turn 2, not the last mark), and
    offers that mark's fixes; a phase without marks keeps its plain line."""
    from grpo_lab.memory import MemorySampler
    from grpo_lab.memory.timeline import Timeline

    sampler = MemorySampler(["cpu"], hz=0, host_threshold=0.95)
    host = sampler.readers[0] = SteppedHost()
    timeline = Timeline()
    timeline.listeners.append(sampler)
    with pytest.raises(HostMemoryExceeded) as caught:
        with timeline.phase("rollout", 0):
            for mark, used in (("turn 1", 0.6), ("tools 1", 0.7), ("turn 2", 0.99), ("tools 2", 0.8), ("turn 3", 0.7)):
                host.used = 0.55
                sampler.mark(mark)
                host.used = used
                sampler.read()  # a reading inside the mark
    assert caught.value.mark == "turn 2" and "during phase 'rollout' of step 0, at turn 2" in str(caught.value)
    assert all(knob in caught.value.fix for knob in KNOBS)
    host.used = 0.5
    with pytest.raises(HostMemoryExceeded) as plain:
        with timeline.phase("rewards", 0):
            host.used = 0.99
            sampler.read()
    assert plain.value.mark is None and str(plain.value).count("during phase 'rewards' of step 0;") == 1
    assert not any(knob in plain.value.fix for knob in KNOBS)
