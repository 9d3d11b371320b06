"""`builtin:tiny-tools`: the built-in tiny body trained at build time to call a calculator through TRL's Qwen2.5 chat
template (trl/chat_templates/qwen2_5.jinja, its own template, so TRL's helpers read its tool calls), for the
`tiny-tools` preset.

It learns on the arithmetic set's problems, each rendered as the tool loop renders it: with the calculator's schema
in the prompt (TOOLS_SHARE of them) it calls the calculator CALL_SHARE of the time (`<tool_call>` JSON with the sum's
expression), reads the `<tool_response>` (masked out, as the loop masks it) and answers with its number; otherwise it
writes the sum itself ("15 * 8 = 120. <answer>120</answer>"), right only part of the time after so short a training.
A run with the tool can then learn that calling it pays; a run without it (the control) cannot.
"""

from __future__ import annotations

import random

from ..data.arithmetic import SYSTEM_PROMPT, arithmetic_problems
from ..data.calculator import calculator

STEPS = 500  # see BUILTINS["tiny-tools"]
BATCH = 32
LEARNING_RATE = 3e-3
WARMUP = 30
TOOLS_SHARE = 0.75  # the rows whose prompt offers the calculator; the others learn to answer without it
CALL_SHARE = 0.3  # of those, the ones that call it: the tool-use rate GRPO starts from
# whole tokens: Qwen2.5's own tool tags, and the template's two fixed texts around the tools' schemas (why: ~130 tokens
# of boilerplate in every prompt would make the build's training steps 3x as long)
ADDED_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>",
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>",
)
DATA_SEED = 2000  # why apart from the run seeds: the training rows are not the preset's prompt order


def chat_template() -> str:
    """TRL's Qwen2.5 template, byte for byte: TRL's add_response_schema recognises it by its text."""
    from trl.chat_template_utils import qwen2_5_chat_template

    return qwen2_5_chat_template


def conversations(tokenizer, n: int, seed: int) -> list[list[tuple[str, bool]]]:
    """`n` training rows as (text, trained) pieces in the order the tool loop produces their tokens: the rendered
    prompt (not trained), then the model's turns (trained) and the tool's suffix (not trained)."""
    from transformers.utils import get_json_schema

    tools = [get_json_schema(calculator)]
    pick = random.Random(seed)
    rows = []
    for r in arithmetic_problems(n, seed, worked=True):
        expression, _, _ = r["solution"].rpartition(" = ")
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": r["prompt"]}]
        offered = pick.random() < TOOLS_SHARE
        prompt = render(tokenizer, messages, tools if offered else None, True)
        if not (offered and pick.random() < CALL_SHARE):
            rows.append([(prompt, False), (f"{r['solution']} <answer>{r['answer']}</answer><|im_end|>", True)])
            continue
        call = {"role": "assistant", "content": "", "tool_calls": [_call(expression)]}
        result = {"role": "tool", "name": "calculator", "content": calculator(expression)}
        called = render(tokenizer, messages + [call], tools, False)
        answered = render(tokenizer, messages + [call, result], tools, True)
        turn = called[len(prompt) : called.rindex("<|im_end|>") + len("<|im_end|>")]
        suffix = called[len(prompt) + len(turn) :] + answered[len(called) :]  # what follows the call's EOS
        rows.append(
            [(prompt, False), (turn, True), (suffix, False), (f"<answer>{r['answer']}</answer><|im_end|>", True)]
        )
    return rows


def _call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


def render(tokenizer, messages: list[dict], tools, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)


def corpus(tokenizer, n: int, seed: int) -> list[str]:
    """Texts for the tokenizer's merges: whole rendered conversations."""
    return ["".join(text for text, _ in row) for row in conversations(tokenizer, n, seed)]


def tool_examples(tokenizer, n: int, seed: int):
    """(input_ids, attention_mask, labels) of `n` rows, right-padded; the loss on the model's turns only."""
    import torch

    encoded = []
    for row in conversations(tokenizer, n, seed):
        ids, labels = [], []
        for text, trained in row:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            labels += piece if trained else [-100] * len(piece)
        encoded.append((ids, labels))
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((n, width), tokenizer.pad_token_id)
    mask = torch.zeros((n, width), dtype=torch.long)
    targets = torch.full((n, width), -100)
    for i, (ids, labels) in enumerate(encoded):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
        targets[i, : len(ids)] = torch.tensor(labels)
    return input_ids, mask, targets


def train_with_tools(model, tokenizer, steps: int = STEPS, seed: int = 0, on_step=None) -> float:
    """models/tiny_train.py's supervised loop over the tool conversations; returns the last batch's loss."""
    from .tiny_train import supervised

    ids, mask, labels = tool_examples(tokenizer, steps * BATCH, DATA_SEED + seed)
    return supervised(model, (ids, mask, labels), steps, BATCH, LEARNING_RATE, WARMUP, on_step)
