"""The built-in tiny model writes readable answers (issue 25): `builtin:tiny-qwen2` is trained on first use
(grpo_lab/models/tiny_train.py) and its greedy completions read as worked solutions."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.xdist_group("tiny_trained")  # why: its tests share module-scoped state: one worker builds it

WORKED = re.compile(r"^\d+ [-+*] \d+ = -?\d+\. <answer>-?\d+( [a-z]+)?</answer>$")


@pytest.fixture(scope="module")
def trained(user_cache):
    from grpo_lab.models.source import resolve_model_path

    return resolve_model_path("builtin:tiny-qwen2")  # built once per session (~1 min), in the session's cache


@pytest.fixture(scope="module")
def greedy(trained):
    """Greedy completions of 48 problems of the demo's set (seed 0), as the hf generator would write them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_lab.data.arithmetic import SYSTEM_PROMPT, arithmetic_problems
    from grpo_lab.data.formats import format_prompt

    tokenizer = AutoTokenizer.from_pretrained(trained)
    model = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32)
    rows = arithmetic_problems(48, 0)
    batch = tokenizer(
        [format_prompt(tokenizer, r["prompt"], SYSTEM_PROMPT) for r in rows],
        return_tensors="pt",
        padding=True,
        add_special_tokens=False,
    )
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=32, do_sample=False)
    return rows, tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def test_greedy_completions_are_worked_answers_that_are_often_right(greedy):
    """Every completion is 'a op b = c. <answer>c[ unit]</answer>' (random weights printed bytes such as
    ' 6\\x7f\\ufffdui'); its sums are right at least a third of the time (0.46 on this machine; all 48 keep a unit)."""
    from grpo_lab.algo.rewards import extract_answer

    rows, texts = greedy
    unreadable = [t for t in texts if not WORKED.match(t)]
    assert len(unreadable) <= 2, unreadable
    right = [extract_answer(t).split()[0] == r["answer"] for t, r in zip(texts, rows) if extract_answer(t)]
    assert sum(right) / len(rows) >= 1 / 3, list(zip(texts, [r["answer"] for r in rows]))


def test_most_answers_carry_a_unit_so_exact_answer_starts_low(greedy):
    """What the demo's GRPO has to learn: the trained answers mostly keep a unit, which exact_answer scores 0."""
    from grpo_lab.algo.rewards import exact_answer

    rows, texts = greedy
    with_unit = [t for t in texts if re.search(r"<answer>-?\d+ [a-z]+</answer>", t)]
    assert len(with_unit) >= 0.6 * len(texts), texts
    assert sum(exact_answer(None, texts, [r["answer"] for r in rows])) <= 0.25 * len(rows)


def test_the_saved_tokenizer_splits_text_as_the_model_was_trained(trained):
    """transformers rebuilds a qwen2 checkpoint's tokenizer with Qwen2's own pre-tokenizer (digits one by one) at
    load. The first trained build learned on a different split and lost its training on reload (loss 0.98 in
    memory, 4.2 from disk); the tokenizer is now trained with Qwen2's split, so both give the same ids."""
    from transformers import AutoTokenizer

    from grpo_lab.models.tiny import _train_tokenizer

    text = "A box holds 15 rows of 8 eggs. 15 * 8 = 120. <answer>120 eggs</answer>"
    trained_with = _train_tokenizer(768, 0, worked=True)
    assert AutoTokenizer.from_pretrained(trained)(text)["input_ids"] == trained_with(text)["input_ids"]
