"""A multi-turn rollout's worst case, said in the plan (a Lab with tools): which turn each rollout line is worst at,
the tool-result bound the plan takes, and what a later turn prefills. Every rollout line is planned at its worst,
the last turn's: the KV cache then holds the prompt and the whole trajectory budget (generator.max_completion_length
is the trajectory's budget, tool results included), however the turns and tool results split it."""

from __future__ import annotations

from typing import Optional


def turns_line(config, tools: Optional[bool] = None) -> Optional[str]:
    """The plan's line on the turns (None without tools: `tools` None reads generator.tools/environment_factory)."""
    gen = config.generator
    if not (tools if tools is not None else bool(gen.tools or gen.environment_factory)):
        return None
    last = gen.max_tool_calling_iterations + 1
    budget, prompt = gen.max_completion_length, gen.max_prompt_length
    bound = gen.max_tool_response_tokens
    result = (
        f"at most {min(bound, budget)} tokens (generator.max_tool_response_tokens)"
        if bound is not None
        else f"bounded by the trajectory budget alone, {budget} tokens (no generator.max_tool_response_tokens)"
    )
    largest = min(bound or budget, budget)
    prefill = (
        f"the tool result's tokens alone, at most {largest} (generator.turn_cache: keep)"
        if gen.turn_cache == "keep" and gen.backend == "hf"
        else f"only what vLLM's prefix cache does not hold (prefix caching on): the tool result's tokens, at most "
        f"{largest}, and the conversation's last, partly filled KV block"
        if gen.backend == "vllm"
        else f"the whole conversation again, up to {prompt + budget} tokens at turn {last} (TRL's loop)"
    )
    return (
        f"multi-turn rollout: at most {last} turns (generator.max_tool_calling_iterations {last - 1} + 1); every "
        f"rollout line is at its worst at the last, turn {last}: the KV cache of the prompt and the whole trajectory "
        f"budget ({budget} tokens, tool results included); a tool result {result}; a turn after the first "
        f"prefills {prefill}"
    )
