"""Tools and the tool loop (grpo_lab/tools/), TRL 1.16 as the oracle where it can be. The loop's edge cases run on
the real tokenizer and chat template (TRL's Qwen2.5 one) with each turn's token ids given (the model's output under
test control); the Lab's tests sample with the real hf backend, a logits processor forcing the first turn's tool call
(the tiny models never write one)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from bench.forced import ForcedTokens
from grpo_lab.errors import ConfigError, LabError

TEMPLATE = "trl:qwen2_5"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def explode(x: int) -> int:
    """Always raises.

    Args:
        x: anything
    """
    raise RuntimeError("boom")


def hang(x: int) -> int:
    """Never returns in time.

    Args:
        x: anything
    """
    time.sleep(5)
    return x


async def hang_async(x: int) -> int:
    """Never returns in time (async).

    Args:
        x: anything
    """
    await asyncio.sleep(5)
    return x


async def add_async(a: int, b: int) -> int:
    """Add two integers, asynchronously.

    Args:
        a: the first
        b: the second
    """
    return a + b


def long_text(x: int) -> str:
    """A result longer than any budget here.

    Args:
        x: anything
    """
    return "word " * 400


def call_text(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call><|im_end|>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    from grpo_lab.tools.template import prepare_for_tools, use_chat_template

    tok = AutoTokenizer.from_pretrained(tiny_model)
    use_chat_template(tok, TEMPLATE)
    prepare_for_tools(tok)
    return tok


def make_loop(tokenizer, tiny_config, tools, **generator):
    from grpo_lab.config.loading import load_config
    from grpo_lab.tools.loop import ToolLoop
    from grpo_lab.tools.toolbox import Toolbox

    config = load_config(tiny_config(generator={"tool_timeout_s": 0.3, **generator}))
    return ToolLoop(Toolbox(tools), tokenizer, [tokenizer.eos_token_id], config)


def scripted(tokenizer, turns: list[str]):
    """The model's output, given: each row's k-th turn is `turns[k]` (the last one repeated), cut to the request's
    budget as a backend cuts it; records each call's contexts."""
    from grpo_lab.generation.base import Sample

    seen: dict[int, int] = {}
    calls = []

    def sample(prompt_ids, rows, request):
        calls.append((list(rows), [list(p) for p in prompt_ids], request.max_completion_length))
        out = []
        for row in rows:
            k = seen.get(row, 0)
            seen[row] = k + 1
            ids = tokenizer(turns[min(k, len(turns) - 1)], add_special_tokens=False)["input_ids"]
            kept = ids[: request.max_completion_length]
            out.append(Sample(kept, [-0.5] * len(kept), truncated=len(kept) < len(ids)))
        return out

    sample.calls = calls
    return sample


def run(loop, tokenizer, turns, budget=400, prompt="What is 2 + 3?"):
    from grpo_lab.algo.containers import GenerationRequest

    request = GenerationRequest(max_completion_length=budget, max_prompt_length=1024)
    episode = loop.start(_batch(prompt), 1, request)
    ids = tokenizer(episode.prompts[0], add_special_tokens=False)["input_ids"]
    sample = scripted(tokenizer, turns)
    out = episode.run([ids], range(1), sample, request)
    return out[0], sample


def _batch(prompt):
    from grpo_lab.algo.containers import PromptBatch

    return PromptBatch(prompts=[prompt], answers=["5"], raw=[prompt])


def trl_suffix_ids(tokenizer, tool_messages):
    """TRL 1.16's own GRPOTrainer._get_tool_suffix_ids on this tokenizer (the oracle)."""
    from trl import GRPOTrainer

    fake = SimpleNamespace(
        processing_class=tokenizer, _tokenizer=tokenizer, chat_template=None, chat_template_kwargs={}, _is_vlm=False
    )
    return GRPOTrainer._get_tool_suffix_ids(fake, tool_messages)


def test_a_tool_call_runs_and_its_result_is_masked_as_trl(tokenizer, tiny_config):
    loop = make_loop(tokenizer, tiny_config, [add])
    first, answer = call_text("add", '{"a": 2, "b": 3}'), "<answer>5</answer><|im_end|>"
    s, sample = run(loop, tokenizer, [first, answer])
    tool = {"role": "tool", "name": "add", "content": "5"}
    assert s.messages == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
        tool,
        {"role": "assistant", "content": "<answer>5</answer>"},
    ]
    a = len(tokenizer(first, add_special_tokens=False)["input_ids"])
    suffix = trl_suffix_ids(tokenizer, [tool])
    b = len(tokenizer(answer, add_special_tokens=False)["input_ids"])
    assert s.completion_ids[a : a + len(suffix)] == suffix  # TRL's tool suffix, as tokens
    assert s.tool_mask == [1] * a + [0] * len(suffix) + [1] * b
    assert s.logprobs[a : a + len(suffix)] == [0.0] * len(suffix)
    assert (s.tool_calls, s.tool_failures, s.turns, s.truncated) == (1, 0, 2, False)
    # the second turn re-prefilled the whole conversation: prompt + first turn + the tool's tokens
    assert sample.calls[1][1][0] == sample.calls[0][1][0] + s.completion_ids[: a + len(suffix)]


@pytest.mark.parametrize(
    "tools, call, error",
    [
        ([explode], call_text("explode", '{"x": 1}'), "boom"),
        ([add], call_text("nope", '{"x": 1}'), "Tool nope not found."),
        ([add], call_text("add", '{"a": "two", "b": 3}'), "argument 'a' is str 'two', the tool takes integer"),
        ([add], call_text("add", '{"a": 1, "c": 3}'), "unknown argument(s) ['c']"),
        ([add], call_text("add", '{"a": 1}'), "missing required argument(s) ['b']"),
        ([hang], call_text("hang", '{"x": 1}'), "did not return within 0.3 s"),
        ([hang_async], call_text("hang_async", '{"x": 1}'), "did not return within 0.3 s"),
    ],
    ids=["raises", "unknown-tool", "wrong-type", "unknown-argument", "missing-argument", "hung", "hung-async"],
)
def test_a_failed_call_is_an_error_result_and_the_rollout_goes_on(tokenizer, tiny_config, tools, call, error):
    loop = make_loop(tokenizer, tiny_config, tools)
    began = time.monotonic()
    s, _ = run(loop, tokenizer, [call, "<answer>5</answer><|im_end|>"])
    assert time.monotonic() - began < 3  # a hung tool waits tool_timeout_s, not its 5 s
    assert s.messages[1]["role"] == "tool" and error in s.messages[1]["content"]
    assert s.messages[1]["content"].startswith("{'error': ")  # TRL's str({"error": ...})
    assert (s.tool_calls, s.tool_failures, s.turns) == (1, 1, 2)
    assert s.messages[-1] == {"role": "assistant", "content": "<answer>5</answer>"}


def test_arguments_are_checked_before_the_call(tokenizer, tiny_config):
    called = []

    def record(a: int) -> int:
        """Records its calls.

        Args:
            a: a number
        """
        called.append(a)
        return a

    loop = make_loop(tokenizer, tiny_config, [record])
    s, _ = run(loop, tokenizer, [call_text("record", '{"a": [1]}'), "done<|im_end|>"])
    assert called == [] and "the tool takes integer" in s.messages[1]["content"]


def test_async_tools_run_on_the_loop(tokenizer, tiny_config):
    loop = make_loop(tokenizer, tiny_config, [add_async])
    s, _ = run(loop, tokenizer, [call_text("add_async", '{"a": 2, "b": 5}'), "7<|im_end|>"])
    assert s.messages[1] == {"role": "tool", "name": "add_async", "content": "7"} and s.tool_failures == 0


def test_a_malformed_call_is_text_and_the_row_ends_as_trl(tokenizer, tiny_config):
    """TRL's parse_response falls back to plain text on a call it cannot parse: no tool call, the row ends."""
    loop = make_loop(tokenizer, tiny_config, [add])
    broken = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3\n</tool_call><|im_end|>'
    s, sample = run(loop, tokenizer, [broken, "never"])
    assert len(sample.calls) == 1 and s.turns == 1 and s.tool_calls == 0
    assert s.messages == [{"role": "assistant", "content": broken.removesuffix("<|im_end|>")}]
    assert s.tool_mask == [1] * len(s.completion_ids)


def test_an_overlong_result_is_left_out_as_trl(tokenizer, tiny_config):
    """A tool result that would pass max_completion_length is left out: the row ends with its tool call."""
    loop = make_loop(tokenizer, tiny_config, [long_text])
    call = call_text("long_text", '{"x": 1}')
    s, sample = run(loop, tokenizer, [call, "never"], budget=200)
    assert len(sample.calls) == 1 and s.turns == 1 and s.tool_calls == 1
    assert [m["role"] for m in s.messages] == ["assistant"] and s.messages[0]["tool_calls"]
    assert s.completion_ids == tokenizer(call, add_special_tokens=False)["input_ids"] and not s.truncated


def test_the_budget_covers_the_whole_trajectory(tokenizer, tiny_config):
    loop = make_loop(tokenizer, tiny_config, [add])
    call = call_text("add", '{"a": 2, "b": 3}')
    a = len(tokenizer(call, add_special_tokens=False)["input_ids"])
    suffix = len(trl_suffix_ids(tokenizer, [{"role": "tool", "name": "add", "content": "5"}]))
    budget = a + suffix + 4
    s, sample = run(loop, tokenizer, [call, "a long answer that goes on<|im_end|>"], budget=budget)
    assert sample.calls[1][2] == 4  # the second turn decodes what is left of the budget
    assert len(s.completion_ids) == budget and s.truncated and s.turns == 2


def test_max_tool_calling_iterations_bounds_the_turns(tokenizer, tiny_config):
    for iterations in (0, 2):
        loop = make_loop(tokenizer, tiny_config, [add], max_tool_calling_iterations=iterations)
        s, _ = run(loop, tokenizer, [call_text("add", '{"a": 2, "b": 3}')], budget=2000)
        assert (s.turns, s.tool_calls) == (1 + iterations, iterations)
        assert s.messages[-1]["tool_calls"] and not s.truncated  # ends with its last call, unanswered (TRL)


# --- through a Lab, with the real hf backend ---


@pytest.fixture
def forced_call(monkeypatch):
    """A logits processor forcing `text` as the first turn of every row of the first generate() call."""
    import grpo_lab.generation.hf as hf

    made = []

    def force(tokenizer, text):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        original = hf.sampling_processors

        def processors(request):
            made.append(request)
            return original(request) + ([ForcedTokens(ids)] if len(made) == 1 else [])

        monkeypatch.setattr(hf, "sampling_processors", processors)

    return force


def tool_lab(tiny_config, reward_funcs, tools=(add,), **generator):
    from grpo_lab import Lab

    cfg = tiny_config(
        model={"chat_template": TEMPLATE},
        generator={
            "max_completion_length": 120,
            "max_prompt_length": 1024,
            "max_tool_calling_iterations": 1,
            **generator,
        },
        grpo={"beta": 0.0, "num_generations": 2, "prompts_per_step": 2},
    )
    return Lab(cfg, reward_funcs=reward_funcs, tools=list(tools)).load()


@pytest.mark.parametrize("decode", ["dynamic", "merged"])
def test_a_lab_rollout_trains_on_the_models_tokens_only(tiny_config, forced_call, decode):
    seen = {}

    def reward(prompts, completions, **kwargs):
        seen["prompts"], seen["completions"] = prompts, completions
        return [float(len(c[-1]["content"]) % 7) for c in completions]  # varied, so the advantages are not 0

    lab = tool_lab(tiny_config, [reward], hf_decode=decode)  # (merged: the turns decode with the rollout copy)
    tok = lab.learner.tokenizer
    call = call_text("add", '{"a": 2, "b": 3}')
    forced_call(tok, call)
    rollout = lab.rollout()
    a = len(tok(call, add_special_tokens=False)["input_ids"])
    suffix = trl_suffix_ids(tok, [{"role": "tool", "name": "add", "content": "5"}])
    for i in range(len(rollout)):
        assert rollout.completion_ids[i, a : a + len(suffix)].tolist() == suffix
        assert rollout.tool_mask[i, : a + len(suffix)].tolist() == [1] * a + [0] * len(suffix)
        assert rollout.conversations[i][1] == {"role": "tool", "name": "add", "content": "5"}
    assert "<tools>" in rollout.batch.prompts[0]  # the prompt renders the tools' schemas
    rewards = lab.rewards(rollout)
    assert seen["completions"] == rollout.conversations  # TRL's conversational form, assistant and tool turns
    assert seen["prompts"][0][-1]["role"] == "user"
    advantages = lab.advantages(rewards)
    stats = lab.backward(rollout, advantages, lab.logprobs(rollout))
    # the rollout's first update is at ratio 1: the DAPO loss is -sum(A_i * n_i) / sum(n_i) over the model's tokens
    n = (rollout.completion_mask * rollout.tool_mask).sum(-1).float()
    assert stats.num_tokens == int(n.sum())
    assert stats.loss == pytest.approx(-(advantages.values * n).sum().item() / n.sum().item(), abs=1e-5)
    lab.optimizer()
    result = lab.sync()
    assert result.tool_calls_per_row == 1.0 and result.tool_failure_frequency == 0.0 and result.turns_mean == 2.0
    assert result.metrics()["tool_calls_per_row"] == 1.0
    assert "tools 1.00/row (failed 0.00), 2.00 turns" in result.summary()  # the run's and the panel's step line
    lab.close()


def test_a_lab_without_tool_calls_steps_as_before(tiny_config):
    lab = tool_lab(tiny_config, ["length"], max_completion_length=12)
    result = lab.step()
    assert result.turns_mean == 1.0 and result.tool_calls_per_row == 0.0
    lab.close()


# --- bad input: one line each ---


def nohint(a, b: int) -> int:
    """No hint on a.

    Args:
        a: first
        b: second
    """


def nodoc(a: int) -> int:
    return a


@pytest.mark.parametrize(
    "tool, words",
    [(nohint, ["nohint", "Argument a is missing a type hint"]), (nodoc, ["nodoc", "no docstring"])],
)
def test_a_tool_without_hints_or_docstring_is_refused_at_construction(tiny_config, tool, words):
    from grpo_lab import Lab

    with pytest.raises(LabError) as err:
        Lab(tiny_config(), tools=[tool])
    line = str(err.value)
    assert "\n" not in line and all(w in line for w in words) and "type hint" in line


@pytest.mark.parametrize(
    "sections, words",
    [
        (
            {"placement": {"learner_procs": 2}, "generator": {"backend": "vllm"}},
            "a sharded learner .* decodes the tool loop's turns on its ranks' hf generators, not generator.backend "
            "vllm",
        ),
    ],
)
def test_tools_where_they_cannot_run_are_refused(tiny_config, sections, words):
    from grpo_lab import Lab

    with pytest.raises(LabError, match=words):
        Lab(tiny_config(**sections), tools=[add])


def test_a_template_that_cannot_render_tools_is_refused_at_load(tiny_config):
    from grpo_lab import Lab

    lab = Lab(tiny_config(), tools=[add])  # the tiny model's own template renders no tool calls
    with pytest.raises(LabError, match="cannot render a tool-calling conversation.*model.chat_template"):
        lab.load()


@pytest.mark.parametrize(
    "field, value",
    [
        ("generator.max_tool_calling_iterations", -1),
        ("generator.max_tool_calling_iterations", 1.5),
        ("generator.max_tool_calling_iterations", True),
        ("generator.tool_timeout_s", 0),
    ],
)
def test_bad_tool_knobs_are_one_line(tiny_config, field, value):
    from grpo_lab.config.loading import load_config

    section, name = field.split(".")
    with pytest.raises(ConfigError, match=field):
        load_config(tiny_config(**{section: {name: value}}))


def test_a_max_prompt_length_that_would_cut_the_tools_is_one_line(tiny_config):
    lab = tool_lab(tiny_config, ["length"], max_prompt_length=128)
    with pytest.raises(LabError, match=r"generator.max_prompt_length: 128 tokens would cut .* raise it to at least"):
        lab.rollout()
    lab.close()


def test_tools_named_in_the_config(tiny_config):
    """grpo-lab run and papermill name them as module:name (generator.tools, generator.environment_factory)."""
    from grpo_lab import Lab

    lab = Lab(tiny_config(generator={"tools": ["test_tools:add"], "environment_factory": "test_environments:Alpha"}))
    tools = lab.executor.tools
    assert tools.toolbox.functions == {"add": add} and tools.environments.factories[None].__name__ == "Alpha"
    assert Lab(
        tiny_config(generator={"tools": ["test_tools:add"]}), tools=[explode]
    ).executor.tools.toolbox.functions == {"explode": explode}  # the Lab's own tools win
    with pytest.raises(LabError, match=r"generator.tools: cannot import 'test_tools:nope' \(.*\); check the module"):
        Lab(tiny_config(generator={"tools": ["test_tools:nope"]}))


def test_an_unknown_trl_template_is_one_line(tokenizer):
    from grpo_lab.tools.template import use_chat_template

    with pytest.raises(LabError, match="TRL ships no template 'trl:nope'"):
        use_chat_template(tokenizer, "trl:nope")
