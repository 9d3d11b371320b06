"""A tool-calling rollout turn by turn from cells (grpo_lab/turns_api.py): `lab.rollout(turns=k)` runs k more turns and
leaves the rollout pending, returning what each row called and each tool answered; `lab.rollout()` ends it with the
tokens one uninterrupted rollout samples (greedy and seeded sampling); live edits between turns apply to the turns still
to run, those the turns run cannot honour are one line; a failure in a later turn undoes the whole phase. The rows'
tool calls are forced as in tests/test_turn_cache.py (the tiny random model never writes one): every row calls add(2, 3)
in its first turn, half of them in the second, none in the third (the turn cap is 2 rounds)."""

from __future__ import annotations

import gc

import pytest
import torch
from test_environments import Guess
from test_tools import call_text, scripted, tokenizer  # noqa: F401 (a fixture)
from test_turn_cache import add, forced_turns

from grpo_lab.errors import LabError

CAP = 2


@pytest.fixture(scope="module")
def lab(tiny_model):
    """One tool Lab of 4 rows for the module, its turns forced; each test starts it afresh at a step's start."""
    from conftest import tiny_dict

    from grpo_lab import Lab

    cfg = tiny_dict(
        tiny_model,
        model={"chat_template": "trl:qwen2_5"},
        generator={"max_completion_length": 300, "max_prompt_length": 1024, "max_tool_calling_iterations": CAP},
        grpo={"beta": 0.0, "num_generations": 2, "prompts_per_step": 2},
    )
    lab = Lab(cfg, reward_funcs=["length"], tools=[add]).load()
    with pytest.MonkeyPatch.context() as patch:
        lab.made = forced_turns(patch, lab.learner.tokenizer, CAP)
        yield lab
    lab.close()


@pytest.fixture
def fresh(lab):
    """The Lab with no rollout pending, its config as built, seeded; its forced turns counted from the first."""
    yield lambda temperature=0.0: start(lab, temperature)
    lab.rollback()
    lab.configure(generator={"max_tool_calling_iterations": CAP, "chunk_size": None, "temperature": 0.0})


def start(lab, temperature: float):
    lab.rollback()
    lab.configure(generator={"max_tool_calling_iterations": CAP, "chunk_size": None, "temperature": temperature})
    lab.made.clear()
    torch.manual_seed(7)
    return lab


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_turn_by_turn_samples_what_one_rollout_samples(fresh, temperature):
    lab = fresh(temperature)
    whole = lab.rollout()
    streams, position = torch.get_rng_state(), lab.prompts.state_dict()
    assert max(whole.turns) == CAP + 1 and min(whole.turns) < max(whole.turns)  # rows stop at different turns
    lab = fresh(temperature)
    first = lab.rollout(turns=1)
    assert lab.next_phase() == "rollout" and lab.current.rollout is None  # pending: not a finished rollout phase
    second = lab.rollout(turns=1)
    assert (first.turns, second.turns) == (1, 2) and second.going == 2
    out = lab.rollout()
    assert lab.current.rollout is out and lab.current.turns is None and lab.next_phase() == "rewards"
    assert out.turns == whole.turns
    assert torch.equal(out.completion_ids, whole.completion_ids)
    assert torch.equal(out.tool_mask, whole.tool_mask) and out.conversations == whole.conversations
    torch.testing.assert_close(out.sampler_logprobs, whole.sampler_logprobs, atol=1e-4, rtol=0)
    # the random streams and the prompt source end where the uninterrupted rollout left them
    assert torch.equal(torch.get_rng_state(), streams) and lab.prompts.state_dict() == position


def test_the_view_shows_each_rows_calls_and_tool_answers(fresh):
    from transformers import DynamicCache

    lab = fresh()
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, DynamicCache)}  # (an earlier test's, in this worker)
    view = lab.rollout(turns=1)
    assert view.turns == 1 and view.going == 4 and [r["row"] for r in view.rows] == [0, 1, 2, 3]
    for row in view.rows:
        assert row["calls"] == [{"turn": 1, "name": "add", "arguments": {"a": 2, "b": 3}}]
        assert row["answers"] == [{"turn": 1, "name": "add", "content": "5"}]
    assert "row 0: turn 1 add({'a': 2, 'b': 3}) -> '5'" in repr(view)
    # the memory it says it holds: no KV cache between calls; the next turn prefills the rows' conversations
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, DynamicCache) and id(o) not in before]
    ids = lab.generator.turns.paused.rows
    assert view.prefill_tokens == sum(len(t.prompt) + len(t.ids) for t in ids.values()) > 0
    view = lab.rollout(turns=1)
    assert view.turns == 2 and sum(len(r["calls"]) for r in view.rows) > 4  # the second turn's calls and answers too
    assert all(len(r["calls"]) == len(r["answers"]) for r in view.rows)
    assert "(done)" in repr(view) and 0 < view.going < 4


def test_a_turn_cap_lowered_between_turns_stops_the_rollout_there(fresh):
    lab = fresh()
    lab.rollout(turns=1)
    with pytest.raises(LabError) as err:
        lab.configure(generator={"max_tool_calling_iterations": 0})
    assert str(err.value) == (
        "generator.max_tool_calling_iterations: 0 is below the 1 round(s) of tool calls this step's pending rollout "
        "has run; set it to at least 1 (its rows then stop at turn 2), or drop the pending turns with lab.rollback()"
    )
    assert lab.config.generator.max_tool_calling_iterations == CAP  # refused: nothing applied
    lab.configure(generator={"max_tool_calling_iterations": 1})
    out = lab.rollout()
    assert max(out.turns) == 2  # uninterrupted at the cap of 3, a row runs 4 turns


def test_the_rows_in_flight_edited_between_turns_apply_to_the_next(fresh):
    lab = fresh()
    lab.rollout(turns=1)
    assert len(lab.made) == 1  # one generate call for the 4 rows
    lab.configure(generator={"chunk_size": 2})
    view = lab.rollout(turns=1)
    assert len(lab.made) == 3 and view.going  # the second turn: 2 calls of 2 rows


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_failure_in_turn_two_undoes_the_whole_rollout_phase(fresh, temperature):
    expected = fresh(temperature).rollout()  # what the step's rollout samples where nothing fails
    lab = fresh(temperature)
    lab.rollout(turns=1)
    attempts, prompts = lab.current.attempts, lab.generator.turns.paused.batch.prompts
    lab.arm_fault(0, "rollout", "oom")  # the 3rd decoding step of the next call: inside turn 2
    with pytest.raises(LabError, match=r"out of memory in phase 'rollout'") as err:
        lab.rollout(turns=1)
    assert "\n" not in str(err.value)
    assert lab.current.turns is None and lab.generator.turns.paused is None and lab.next_phase() == "rollout"
    assert "rollout" not in lab.timeline.seconds(lab.step_index)  # both calls filed as the failed attempt
    assert lab.current.attempts == attempts + 1
    lab.made.clear()  # (the forced calls count the turns from the first again)
    out = lab.rollout()  # the step goes on from its rollout, on its own prompts, drawing its seeds again
    assert out.batch.prompts == prompts and max(out.turns) == CAP + 1
    assert torch.equal(out.completion_ids, expected.completion_ids) and out.turns == expected.turns


def test_lab_rollback_drops_the_pending_turns(fresh):
    lab = fresh()
    lab.rollout(turns=1)
    attempts, prompts = lab.current.attempts, lab.generator.turns.paused.batch.prompts
    lab.rollback()
    assert lab.current.turns is None and lab.generator.turns.paused is None and lab.next_phase() == "rollout"
    assert lab.current.attempts == attempts + 1 and "rollout" not in lab.timeline.seconds(lab.step_index)
    lab.made.clear()
    out = lab.rollout()
    assert out.batch.prompts == prompts and max(out.turns) == CAP + 1


PENDING = "finish them with lab.rollout() or drop them with lab.rollback(), first"


@pytest.mark.parametrize(
    "call, line",
    [
        (lambda lab: lab.probe(), f"lab.probe(): step 0's rollout has turns pending; {PENDING}"),
        (lambda lab: lab.save_checkpoint("x"), f"lab.save_checkpoint(): step 0's rollout has turns pending; {PENDING}"),
        (lambda lab: lab.rewards(None), f"rewards: step 0's rollout has turns pending; {PENDING}"),
        (
            lambda lab: lab.configure(generator={"temperature": 0.5}),
            "generator.temperature: this step's rollout has turns pending, sampled with 0.0; finish them with "
            "lab.rollout() or drop them with lab.rollback(), then edit it",
        ),
        (
            lambda lab: lab.executor.compute("rollout", lab.current),  # anything else that would start a rollout
            "rollout: this step's rollout has turns pending (lab.rollout(turns=...)); finish them with lab.rollout() "
            "or drop them with lab.rollback(), before another rollout",
        ),
    ],
)
def test_a_second_rollout_or_an_edit_while_turns_are_pending_is_one_line(fresh, call, line):
    lab = fresh()
    lab.rollout(turns=1)
    with pytest.raises(LabError) as err:
        call(lab)
    assert str(err.value) == line
    assert lab.current.turns is not None  # still pending, and it goes on
    assert lab.rollout(turns=1).turns == 2


@pytest.mark.parametrize("turns", [0, -1, True, 1.5])
def test_turns_not_a_positive_count_is_one_line(fresh, turns):
    lab = fresh()
    phase = lab.next_phase()  # (rollout, or rewards after a test that ran its rollout whole: xdist's order)
    with pytest.raises(LabError) as err:
        lab.rollout(turns=turns)
    assert str(err.value) == (
        f"lab.rollout(turns={turns!r}): turns is how many more turns to run, at least 1; pass turns=1, or call "
        "lab.rollout()"
    )
    assert lab.current.turns is None and lab.next_phase() == phase  # (nothing ran)


def test_turn_by_turn_without_tools_is_one_line(loaded_lab):
    lab = loaded_lab()
    try:
        with pytest.raises(LabError) as err:
            lab.rollout(turns=1)
        assert str(err.value) == (
            "lab.rollout(turns=1): this Lab has no tools, so its rollout is one turn; call lab.rollout(), or make a "
            "Lab with tools=[...] (or environment_factory=...)"
        )
    finally:
        lab.close()


@pytest.mark.parametrize(
    "sections, words",
    [
        ({"generator": {"backend": "vllm"}}, "generator.backend 'vllm' cannot pause a rollout between turns (only hf"),
        ({"placement": {"learner_procs": 2}}, "a sharded learner (placement.learner_procs = 2) cannot pause"),
    ],
)
def test_turn_by_turn_where_the_rollout_cannot_pause_is_one_line(tiny_config, sections, words):
    from grpo_lab.config.loading import load_config
    from grpo_lab.turns_api import check_pauses

    with pytest.raises(LabError) as err:
        check_pauses(load_config(tiny_config(**sections)), "lab.rollout(turns=1)")
    assert str(err.value).startswith(f"lab.rollout(turns=1): {words}")
    assert str(err.value).endswith("; call lab.rollout() for the whole rollout")


def test_lab_step_finishes_a_pending_rollout_and_the_step(fresh):
    lab = fresh()
    lab.rollout(turns=1)
    index = lab.step_index
    result = lab.step()  # the rest of the step: the pending rollout's turns first
    assert lab.step_index == index + 1 and result.turns_mean > 1
    assert [r["mark"] for r in result.turn_memory if r["device"] == "host" and r["metric"] == "used"][:3] == [
        "turn 1",
        "tools 1",
        "turn 2",
    ]  # the marks of the pending rollout's calls, in order
    assert "rollout" in result.phase_seconds and "rollout" in lab.memory_table()


def test_a_paused_episode_keeps_its_environments_and_ends_as_one_run(tokenizer, tiny_config):  # noqa: F811
    """Through the loop with given turns: an environment_factory row's environment is reset once, keeps its state
    between the calls, and the row ends as in one uninterrupted run."""
    from grpo_lab.algo.containers import GenerationRequest, PromptBatch
    from grpo_lab.config.loading import load_config
    from grpo_lab.tools.environments import Environments
    from grpo_lab.tools.loop import ToolLoop

    turns = [call_text("guess", '{"n": 1}'), call_text("guess", '{"n": 5}'), "<answer>5</answer><|im_end|>"]
    batch = PromptBatch(prompts=["What is 2 + 3?"], answers=["5"], extra={"answer": ["5"]}, raw=["What is 2 + 3?"])
    request = GenerationRequest(400, max_prompt_length=2048)

    def calls(stops):
        config = load_config(tiny_config(generator={"max_tool_calling_iterations": 3}))
        loop = ToolLoop(None, tokenizer, [tokenizer.eos_token_id], config, Environments(Guess, []))
        given, episodes = scripted(tokenizer, turns), []
        for stop in stops:
            with loop.continuing(stop):
                episodes.append(loop.start(batch, 1, request))
                ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in episodes[-1].prompts]
                out = episodes[-1].run(ids, range(1), given, request)
        assert all(e is episodes[0] for e in episodes)  # each call goes on from the paused episode
        return out[0], episodes[0]

    whole, _ = calls([None])
    Guess.made.clear()
    out, episode = calls([1, 2, None])
    (env,) = episode.environments
    assert Guess.made == [env] and len(env.resets) == 1 and env.guesses == [1, 5]  # one reset; its state kept
    assert (out.completion_ids, out.tool_mask, out.messages) == (whole.completion_ids, whole.tool_mask, whole.messages)
    assert out.turns == 3 and out.tool_calls == 2
