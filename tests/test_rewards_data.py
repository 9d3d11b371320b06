import json

import pytest
import torch

from grpo_lab import Lab, LabError
from grpo_lab.algo.rewards import exact_answer, extract_answer, format_reward, length_reward, resolve_reward
from grpo_lab.data.arithmetic import arithmetic_problems
from grpo_lab.data.prompts import PromptSource


def test_extract_and_exact_answer():
    assert extract_answer("so <answer> 12 </answer>") == "12"
    assert extract_answer("it is 3 then 7") == "7"
    assert extract_answer("nothing") is None
    assert exact_answer([""] * 3, ["<answer>5</answer>", "5", "six"], answer=["5", "5", "6"]) == [1.0, 1.0, 0.0]
    with pytest.raises(LabError, match="answer"):
        exact_answer([""], ["x"])
    chat = [[{"role": "assistant", "content": "<answer>5</answer>"}]]  # TRL's conversational format
    assert exact_answer([""], chat, answer=["5"]) == [1.0] and format_reward([""], chat) == [1.0]


def test_exact_answer_compares_numbers_as_numbers_whatever_type_the_column_holds():
    # an answer column Arrow reads as float (2.0), or an int column, against a completion's "2"
    completions = ["<answer>2</answer>", "2.0", "<answer>-3.50</answer>", "<answer>7</answer>", "<answer>two</answer>"]
    assert exact_answer([""] * 5, completions, answer=[2.0, 2, "-3.5", 7.25, "two"]) == [1.0, 1.0, 1.0, 0.0, 1.0]


def test_format_and_length_rewards():
    assert format_reward([""] * 3, ["<answer>4</answer>", "<answer>four</answer>", "4"]) == [1.0, 0.5, 0.0]
    assert length_reward([""] * 3, ["", "", ""], completion_ids=[[1] * 16, [1] * 8, [1] * 40]) == [1.0, 0.5, -0.5]


def test_the_concise_reward_tells_apart_completions_of_one_token_count_by_their_text():
    cut = [[1] * 192] * 3  # three completions cut at the same max_completion_length
    texts = ["x" * 150, "x" * 400, [{"role": "assistant", "content": "x" * 800}]]
    assert resolve_reward("concise")([""] * 3, texts, completion_ids=cut) == pytest.approx([200 / 350, 1 / 3, 0.2])
    assert resolve_reward("concise")([""] * 2, ["", " 9"]) == pytest.approx([1.0, 200 / 202])  # no flat region
    assert len(set(length_reward([""] * 3, texts, completion_ids=cut))) == 1  # what `length` cannot


def test_resolve_reward_by_name_path_and_callable():
    assert resolve_reward("format") is format_reward
    assert resolve_reward("grpo_lab.algo.rewards:length_reward") is length_reward
    assert resolve_reward(len) is len
    with pytest.raises(LabError, match="cannot import"):
        resolve_reward("no_such_module:f")


def test_a_named_reward_may_take_columns_and_environments_by_name_as_trls_do():
    """A 'module:function' reward is checked against what every call passes (TRL's prompts, completions,
    completion_ids, trainer_state, log_extra, log_metric); a parameter it names beyond them (a column such as TRL's
    `solution`, or `environments`) is the data's to supply, so it is not refused for it."""
    from tests import column_reward

    assert resolve_reward("tests.column_reward:solution_match") is column_reward.solution_match
    assert resolve_reward("tests.column_reward:environment_reward") is column_reward.environment_reward
    assert column_reward.solution_match(completions=[" 4", "5"], solution=["4", "4"], prompts=[], log_metric=None) == [
        1.0,
        0.0,
    ]
    with pytest.raises(LabError, match=r"data.rewards: 'tests.column_reward:no_trainer_state' .*trainer_state"):
        resolve_reward("tests.column_reward:no_trainer_state")


def test_arithmetic_set_is_deterministic_and_correct():
    rows = arithmetic_problems(50, seed=3)
    assert rows == arithmetic_problems(50, seed=3) and rows != arithmetic_problems(50, seed=4)
    assert all(int(r["answer"]) >= 0 for r in rows)


def test_prompt_source_cycles_in_seeded_order():
    class Tok:
        chat_template = None

    rows = [{"prompt": str(i), "answer": str(i)} for i in range(5)]
    a = [PromptSource(rows, Tok(), None, seed=1).next_batch(7).answers for _ in range(2)]
    assert a[0] == a[1] and sorted(a[0][:5]) == ["0", "1", "2", "3", "4"]


def test_user_reward_callable_and_extra_columns(tiny_config, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}", "answer": str(i), "weight": i}) + "\n" for i in range(4)))
    seen = {}

    def my_reward(prompts, completions, completion_ids, answer, weight, **kwargs):
        seen["weight"] = weight
        return [float(len(c) % 3) for c in completions]

    lab = Lab(tiny_config(data={"dataset": str(data), "rewards": ["format"]}), reward_funcs=[my_reward]).load()
    rewards = lab.rewards(lab.rollout())
    assert rewards.names == ["my_reward"] and len(seen["weight"]) == 8


def test_reward_with_wrong_length_is_a_clear_error(loaded_lab):
    lab = loaded_lab()
    lab.reward_funcs = [lambda prompts, completions, **kw: [1.0]]
    with pytest.raises(LabError, match="returned 1 values for 8 completions"):
        lab.rewards(lab.rollout())


def test_unscored_completions_get_zero_advantage(loaded_lab):
    lab = loaded_lab()
    lab.reward_funcs = [
        lambda prompts, completions, **kw: [None if i == 0 else float(i) for i in range(len(completions))]
    ]
    rewards = lab.rewards(lab.rollout())
    adv = lab.advantages(rewards)
    assert torch.isnan(rewards.total[0]) and adv.values[0] == 0 and torch.isfinite(adv.values).all()
