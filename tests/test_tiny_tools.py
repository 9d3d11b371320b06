"""`builtin:tiny-tools` and the `tiny-tools` preset: the model learns at build time on conversations exactly as the tool
loop assembles them (TRL's Qwen2.5 template, TRL's parser, TRL's tool suffix), and GRPO then learns to use its
calculator (slow; the 5-seed comparison with a control is bench/probes/tiny_tools_learns.py)."""

from __future__ import annotations

import json

import pytest

from grpo_lab.data.calculator import calculator


@pytest.fixture(scope="module")
def tokenizer():
    from grpo_lab.models.tiny import _train_tokenizer

    return _train_tokenizer(768, 0, worked=True, tool_calls=True)


def test_the_training_rows_are_what_the_tool_loop_assembles(tokenizer):
    """Prompt, call, tool suffix and answer, each as the loop makes its tokens: a prompt rendered with the calculator's
    schema (tools.template.render_prompt), a call TRL's parser reads as calculator(expression), the suffix TRL's
    _get_tool_suffix_ids cuts (tools.template.tool_suffix_ids), the loss on the model's turns only."""
    from trl.chat_template_utils import add_response_schema, supports_tool_calling

    from grpo_lab.data.arithmetic import SYSTEM_PROMPT
    from grpo_lab.models.tiny_tools import conversations
    from grpo_lab.tools.template import parse, render_prompt, tool_suffix_ids
    from grpo_lab.tools.toolbox import Toolbox

    add_response_schema(tokenizer)  # (raises for a template TRL does not know)
    assert supports_tool_calling(tokenizer)
    schemas = Toolbox([calculator]).schemas
    rows = conversations(tokenizer, 40, 7)
    calls = [r for r in rows if len(r) == 4]
    assert 0 < len(calls) < len(rows)  # some rows call, some answer themselves
    for row in calls:
        (prompt, p), (turn, t), (suffix, s), (answer, a) = row
        assert (p, t, s, a) == (False, True, False, True)
        ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        user = prompt.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
        assert prompt == render_prompt(tokenizer, messages, schemas)
        message = parse(tokenizer, ids(turn), ids(prompt), schemas)
        (call,) = message["tool_calls"]
        expression = call["function"]["arguments"]["expression"]
        result = calculator(expression)
        assert ids(suffix) == tool_suffix_ids(tokenizer, [{"role": "tool", "name": "calculator", "content": result}])
        assert answer == f"<answer>{result}</answer><|im_end|>"


def test_the_saved_tokenizer_keeps_the_tool_tokens(tokenizer, tmp_path):
    """transformers rebuilds a qwen2 checkpoint's tokenizer at load: the added tokens (<tool_call>, the template's
    fixed texts) and TRL's template survive it, so the model is given the ids it learned on."""
    from transformers import AutoTokenizer

    from grpo_lab.models.tiny_tools import chat_template, conversations

    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "".join(t for t, _ in next(r for r in conversations(tokenizer, 20, 3) if len(r) == 4))
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.chat_template == chat_template()


def run_preset(out, *overrides) -> list[dict]:
    from grpo_lab.config.loading import load_config
    from grpo_lab.runner import run

    run_dir = run(load_config("tiny-tools", ["run.steps=8", *overrides]), out=str(out), progress=False)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def first_last(rows: list[dict], key: str) -> tuple[float, float]:
    values = [r.get(key) or 0.0 for r in rows]
    return sum(values[:2]) / 2, sum(values[-2:]) / 2


@pytest.mark.slow
def test_tiny_tools_learns_to_call_its_calculator(user_cache, tmp_path):
    """Seed 0, 8 steps: the calls per row and the correctness reward both rise (measured: see docs/benchmarks.md,
    "tiny-tools"); the 25-step, 5-seed comparison with the control is the benchmark's."""
    rows = run_preset(tmp_path / "tool")
    calls, right = first_last(rows, "tool_calls_per_row"), first_last(rows, "rewards/exact_answer/mean")
    assert calls[1] - calls[0] >= 0.2, [round(r.get("tool_calls_per_row") or 0, 2) for r in rows]
    assert right[1] - right[0] >= 0.15, [round(r["rewards/exact_answer/mean"], 2) for r in rows]
