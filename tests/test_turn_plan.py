"""The plan of a multi-turn rollout (planner/turns.py): the turn each rollout line is worst at, the tool-result bound it
takes (generator.max_tool_response_tokens, or the trajectory budget, said), and what a later turn prefills."""

from __future__ import annotations

from test_turn_cache import add


def _plan(tiny_config, **generator):
    from grpo_lab.config.loading import load_config
    from grpo_lab.planner import plan

    gen = {"tools": ["my_tools:add"], "max_tool_calling_iterations": 3, "max_prompt_length": 100, **generator}
    return plan(load_config(tiny_config(generator=gen)))


def test_the_plan_says_the_worst_turn_and_the_tool_result_bound(tiny_config):
    bounded = _plan(tiny_config, max_tool_response_tokens=32)
    assert "at most 4 turns" in bounded.turns and "worst at the last, turn 4" in bounded.turns
    assert "prompt and the whole trajectory budget (16 tokens, tool results included)" in bounded.turns
    assert "at most 16 tokens (generator.max_tool_response_tokens)" in bounded.turns  # (the budget is smaller)
    assert "the tool result's tokens alone, at most 16 (generator.turn_cache: keep)" in bounded.turns
    assert "multi-turn rollout: at most 4 turns" in str(bounded)  # the printed plan says it, under its header
    unbounded = _plan(tiny_config, max_completion_length=256, turn_cache="prefill")
    assert "bounded by the trajectory budget alone, 256 tokens (no generator.max_tool_response_tokens)" in (
        unbounded.turns
    )
    assert "the whole conversation again, up to 356 tokens at turn 4 (TRL's loop)" in unbounded.turns


def test_no_turns_line_without_tools(tiny_config):
    from grpo_lab.config.loading import load_config
    from grpo_lab.planner import plan

    assert plan(load_config(tiny_config())).turns is None
    assert "multi-turn" not in str(plan(load_config(tiny_config())))


def test_a_lab_with_tools_plans_its_turns(tiny_config):
    from grpo_lab import Lab

    lab = Lab(tiny_config(model={"chat_template": "trl:qwen2_5"}), reward_funcs=["length"], tools=[add])
    assert "at most 6 turns" in lab.plan().turns  # (max_tool_calling_iterations 5, the default)
    lab.close()
