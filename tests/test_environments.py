"""environment_factory as TRL 1.16 takes it (grpo_lab/tools/environments.py): one pooled instance per rollout row,
reset(**row) and its observation, public methods as the row's tools, get_reward as a reward source, environments=
to the rewards; a dict of environments chosen per row. Through a Lab with the real hf backend (the first turn's tool
call forced, tests/test_tools.py's fixture) and through the loop with given turns."""

from __future__ import annotations

import pytest
from test_tools import TEMPLATE, call_text, forced_call, scripted, tokenizer  # noqa: F401 (fixtures)

from grpo_lab.algo.containers import GenerationRequest, PromptBatch
from grpo_lab.errors import LabError

ROWS = [{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "What is 1 + 1?", "answer": "2"}]


class Guess:
    made: list = []

    def __init__(self):
        Guess.made.append(self)
        self.answer, self.guesses, self.resets = None, [], []

    def reset(self, **row):
        self.resets.append(row)
        self.answer, self.guesses = row["answer"], []
        return " Use the guess tool."

    def guess(self, n: int) -> str:
        """Guess the answer.

        Args:
            n: the guess
        """
        self.guesses.append(n)
        return "right" if str(n) == self.answer else "wrong"

    def get_reward(self) -> float:
        return float(any(str(g) == self.answer for g in self.guesses))

    def _private(self):
        raise AssertionError("not a tool")


def test_each_row_has_its_environment_as_trl(tiny_config, forced_call):  # noqa: F811
    from grpo_lab import Lab

    seen = {}

    def spy(prompts, completions, environments=None, **kwargs):
        seen.setdefault("environments", []).append(environments)
        return [0.0] * len(completions)

    Guess.made.clear()
    cfg = tiny_config(
        model={"chat_template": TEMPLATE},
        generator={"max_completion_length": 120, "max_prompt_length": 1024, "max_tool_calling_iterations": 1},
        grpo={"beta": 0.0, "num_generations": 2, "prompts_per_step": 2},
    )
    lab = Lab(cfg, reward_funcs=[spy], train_dataset=ROWS, environment_factory=Guess).load()
    forced_call(lab.learner.tokenizer, call_text("guess", '{"n": 5}'))
    rollout = lab.rollout()
    envs = rollout.environments
    # one a row: the probe made at construction, then three more (TRL's pool starts with the probe)
    assert len(envs) == 4 and len({id(e) for e in envs}) == 4 and Guess.made == envs
    for i, env in enumerate(envs):
        answer = rollout.batch.answers[i // 2]
        assert env.resets[-1] == next(r for r in ROWS if r["answer"] == answer)  # reset(**row): the dataset's row
        assert env.answer == answer and env.guesses == [5]  # its own instance's tool ran
        assert rollout.conversations[i][1]["content"] == ("right" if answer == "5" else "wrong")
        assert rollout.row_prompts[i][-1]["content"].endswith("? Use the guess tool.")  # reset's observation
    assert "Use the guess tool." in rollout.batch.prompts[0] and '"name": "guess"' in rollout.batch.prompts[0]
    rewards = lab.rewards(rollout)
    assert rewards.names == ["spy", "Guess"] and seen["environments"] == [envs]
    expected = [float(rollout.batch.answers[i // 2] == "5") for i in range(4)]
    assert rewards.per_function[:, 1].tolist() == expected  # get_reward, weight 1
    assert rewards.total.tolist() == expected
    lab.step()  # the rest of the step, then the next: the pool's instances are reset, not made anew
    lab.step()
    assert len(Guess.made) == 4 and all(len(e.resets) == 2 for e in envs)  # (step 0 ends, step 1 rolls out)
    lab.close()


class Alpha:
    def reset(self, **row):
        self.row = row

    def alpha(self, x: int) -> int:
        """Alpha's tool.

        Args:
            x: a number
        """
        return x + 1


class Beta(Alpha):
    def beta(self, x: int) -> int:
        """Beta's tool.

        Args:
            x: a number
        """
        return x - 1


def episode_of(tokenizer, tiny_config, factory, extra, tools=()):  # noqa: F811
    from grpo_lab.config.loading import load_config
    from grpo_lab.tools.environments import Environments
    from grpo_lab.tools.loop import ToolLoop

    config = load_config(tiny_config())
    loop = ToolLoop(None, tokenizer, [tokenizer.eos_token_id], config, Environments(factory, list(tools)))
    batch = PromptBatch(prompts=["q0", "q1"], answers=[None, None], extra=extra, raw=["q0", "q1"])
    return loop.start(batch, 1, GenerationRequest(200, max_prompt_length=2048))


def test_a_dict_of_environments_is_chosen_per_row(tokenizer, tiny_config):  # noqa: F811
    episode = episode_of(tokenizer, tiny_config, {"a": Alpha, "b": Beta}, {"environment": ["a", "b"], "k": [1, 2]})
    a, b = episode.prompts
    assert '"name": "alpha"' in a and '"name": "beta"' not in a  # only its environment's tools are rendered
    assert '"name": "beta"' in b and '"name": "alpha"' in b  # (Beta's inherited method is a tool too)
    assert [type(e) for e in episode.environments] == [Alpha, Beta]
    assert episode.environments[0].row == {"prompt": "q0", "k": 1}  # the 'environment' column is not passed
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in episode.prompts]
    given = scripted(tokenizer, [call_text("beta", '{"x": 1}'), "ok<|im_end|>"])
    out = episode.run(ids, range(2), given, GenerationRequest(200))
    assert out[0].messages[1]["content"] == "{'error': 'Tool beta not found.'}" and out[0].tool_failures == 1
    assert out[1].messages[1]["content"] == "0" and out[1].tool_failures == 0


def test_a_missing_or_unknown_environment_column_is_one_line(tokenizer, tiny_config):  # noqa: F811
    with pytest.raises(LabError, match="needs an 'environment' column"):
        episode_of(tokenizer, tiny_config, {"a": Alpha}, {})
    with pytest.raises(LabError, match=r"environment\(s\) \['c'\], not among \['a', 'b'\]"):
        episode_of(tokenizer, tiny_config, {"a": Alpha, "b": Beta}, {"environment": ["a", "c"]})


class NoReset:
    def tool(self, x: int) -> int:
        """A tool.

        Args:
            x: a number
        """
        return x


class Undocumented:
    def reset(self, **row):
        pass

    def tool(self, x: int) -> int:
        return x


@pytest.mark.parametrize(
    "factory, words",
    [(NoReset, "NoReset has no reset method"), (Undocumented, "tools: tool: Cannot generate JSON schema for tool")],
)
def test_a_bad_environment_is_refused_at_construction(tiny_config, factory, words):
    from grpo_lab import Lab

    with pytest.raises(LabError, match=words) as err:
        Lab(tiny_config(), environment_factory=factory)
    assert "\n" not in str(err.value)
