"""The plan counts the tools: a prompt rendered with `tools=` carries their schemas (TRL's Qwen2.5 template writes
them into the system turn), so the plan's prompt line holds the longest prompt as the template really renders it,
tools included, for a loaded Lab and for `grpo-lab plan` (tools named in the config)."""

from __future__ import annotations

import re

from test_tools import TEMPLATE, add, tool_lab


def planned_prompt_tokens(plan) -> int:
    return int(re.search(r"the data's longest, (\d+) tokens", plan.prompts).group(1))


def rendered_longest(lab, schemas) -> int:
    """The longest of the dataset's prompts as the tool loop renders them (tools.loop.as_messages, render_prompt)."""
    from grpo_lab.tools.loop import as_messages
    from grpo_lab.tools.template import render_prompt

    tokenizer, system = lab.executor.learner.tokenizer, lab.config.data.system_prompt
    texts = [render_prompt(tokenizer, as_messages(r["prompt"], system), schemas) for r in lab.executor.prompts.dataset]
    return max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])


def test_tools_raise_the_planned_prompt_to_what_the_template_renders(tiny_config):
    from grpo_lab.tools.toolbox import Toolbox

    lab = tool_lab(tiny_config, ["length"])
    try:
        with_tools = planned_prompt_tokens(lab.plan())
        assert with_tools == rendered_longest(lab, Toolbox([add]).schemas)
        without = rendered_longest(lab, [])
        assert with_tools >= without + 50, (with_tools, without)  # add's schema is ~70 tokens on this tokenizer
    finally:
        lab.close()


def test_grpo_lab_plan_counts_the_tools_named_in_the_config(tiny_config):
    """cli.data_prompt_tokens (grpo-lab plan without a Lab) reads the same length as a loaded Lab plans."""
    from grpo_lab.cli import data_prompt_tokens
    from grpo_lab.config.loading import load_config

    sections = {"model": {"chat_template": TEMPLATE}, "generator": {"max_prompt_length": 1024}}
    plain = data_prompt_tokens(load_config(tiny_config(**sections)))
    sections["generator"]["tools"] = ["test_tools:add"]
    lab = tool_lab(tiny_config, ["length"])
    try:
        assert data_prompt_tokens(load_config(tiny_config(**sections))) == planned_prompt_tokens(lab.plan()) > plain
    finally:
        lab.close()
