"""A multi-turn rollout's plan (a Lab with tools), turn by turn. Turn k of the hf tool loop holds, beside the plan's
resident lines: the KV cache of the prompt and every token so far (earlier turns, tool results, this turn's decoded
tokens), and either its prefill's working memory (beside the KV of its context alone) or one decoding step's [rows,
vocab] buffers, never both at once.
The rollout's planned peak is its worst turn's. Before a run the plan takes every turn at its worst: the KV cache
at the prompt and the whole trajectory budget (generator.max_completion_length, tool results included) at the last
turn; a turn's prefill the prompt (turn 1), the largest tool result (generator.turn_cache keep) or the whole
conversation again (TRL's loop, turn_cache prefill) at the last turn. `turn_peaks` plans the turns a rollout made,
given their tokens (bench/plan_accuracy/turn_plan.py, tests/test_turn_plan.py: each against its measured peak; the hf
backend records them, Rollout.turn_shapes, and notebook 07 prints each turn's beside its measured peak)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..generation.step_memory import PREFILL_CHUNK
from ..models.shapes import ModelShape
from .estimate import MiB, compute_bytes, generation_step_bytes, rollout_sequences

# A Lab with tools imports TRL's chat-template utilities (tools/template.py: trl.chat_template_utils, which loads
# TRL's trainers with it) and keeps them: host RSS at the first rollout's start, a tools Lab less a plain one, both
# builtin:qwen2-152k, CPU torch 2.13, TRL 1.16: 648 and 556 MiB (bench/plan_accuracy/turn_plan.py --baseline,
# 2026-12-05). Measured, not modelled: what an import holds is no function of the shapes planned here
TOOLS_IMPORTS = 92 * MiB


@dataclass
class Turn:
    """One turn of the rows in flight: `prefill` tokens prefilled (turn 1's in chunks: prefill_forwards), `context`
    tokens in the KV cache after that prefill, then `decode` tokens decoded one step at a time."""

    number: int
    rows: int
    prefill: int
    context: int
    decode: int


def uses_tools(config, tools: Optional[bool] = None) -> bool:
    gen = config.generator
    return tools if tools is not None else bool(gen.tools or gen.environment_factory)


def prefill_bytes(shape: ModelShape, config, rows: int, new: int, context: int) -> float:
    """A prefill's working memory on a CPU learner beyond the KV cache, at its last layer, as torch's profiler counts
    its tensors (profile_memory; builtin:tiny-tools, 128 x 136 tokens, float32: 87.3 of a 112.8 MiB peak, the rest the
    KV cache): the boolean padding mask [rows, 1, new, context] for the whole forward; then the larger of the
    attention (the embeddings, the layer's input and its normed copy [rows, new, hidden], the query and sdpa's output
    [rows, heads, new, head_dim], the mask as sdpa's additive float mask: its flash kernel makes no [rows, heads, new,
    context] scores) and the MLP (the embeddings, the layer's input, the residual and the normed copy, with its three
    [rows, new, intermediate]: the gate's activation, the up projection and their product)."""
    e, tokens = compute_bytes(config), rows * new
    hidden, query = tokens * shape.hidden * e, tokens * shape.heads * shape.head_dim * e
    width = shape.intermediate or shape.shared_intermediate  # (a MoE's routed experts are not measured here)
    attention = 3 * hidden + 2 * query + tokens * context * e
    mlp = 4 * hidden + 3 * tokens * width * e
    return tokens * context + max(attention, mlp)


def prefill_forwards(turn: Turn) -> list[tuple[int, int]]:
    """The turn's prefill forwards that can be its worst, (tokens fed, KV context after): turn 1's prefill of the
    prompts feeds PREFILL_CHUNK tokens a forward on a CPU learner (generation/step_memory.py), so its last whole chunk
    and the rest after it; a later turn's prefill, from the kept cache or afresh, is one forward."""
    new, context = turn.prefill, turn.context
    if turn.number != 1 or new != context or new <= PREFILL_CHUNK:
        return [(new, context)]
    whole = new // PREFILL_CHUNK * PREFILL_CHUNK
    return [(PREFILL_CHUNK, whole)] + ([(new - whole, new)] if new > whole else [])


def kv_bytes(shape: ModelShape, config, rows: int, tokens: int) -> float:
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * compute_bytes(config) * rows * tokens


def turn_bytes(shape: ModelShape, config, turn: Turn) -> dict[str, float]:
    """Turn `turn`'s transient host bytes, by term; "peak" is what it holds at its worst."""
    kv = kv_bytes(shape, config, turn.rows, turn.context + turn.decode)
    step = generation_step_bytes(shape, config, turn.rows) if turn.decode else 0.0
    # why two sums: the prefill runs beside the KV of its context alone and is freed before the first decoding step,
    # whose buffers then sit beside the KV the turn's decoded tokens grow
    at_prefill = max(
        kv_bytes(shape, config, turn.rows, end) + prefill_bytes(shape, config, turn.rows, fed, end)
        for fed, end in prefill_forwards(turn)
    )
    prefill = at_prefill - kv_bytes(shape, config, turn.rows, turn.context)
    return {"kv": kv, "prefill": prefill, "step": step, "at_prefill": at_prefill, "peak": max(at_prefill, kv + step)}


def worst_turns(config) -> list[Turn]:
    """Every turn the config allows at its worst (the plan before a run): KV at the prompt and the whole budget."""
    gen = config.generator
    rows, prompt, budget = rollout_sequences(config), gen.max_prompt_length, gen.max_completion_length
    result = min(gen.max_tool_response_tokens or budget, budget)
    keep = gen.turn_cache == "keep" and gen.backend == "hf"
    turns = [Turn(1, rows, prompt, prompt, budget)]
    for k in range(2, gen.max_tool_calling_iterations + 2):
        # why budget - 1 decoded: a later turn comes after at least one decoded token and a tool result
        context = prompt + budget - 1
        turns.append(Turn(k, rows, result + 1 if keep else context, context, 1))
    return turns


def turn_peaks(plan, turns: list[Turn]) -> list[float]:
    """Each turn's planned host peak (bytes): the plan's resident lines and that turn's transients."""
    host = plan.devices["host"]
    return [host.resident + turn_bytes(plan.shape, plan.config, t)["peak"] for t in turns]


def add_turn_items(plan, tools: Optional[bool] = None) -> None:
    """The plan's lines of a tool loop: TRL's imports on the host; on a CPU learner with the hf backend, the worst
    turn's prefill beyond the KV cache and decoding step the plan's other lines hold, and each rollout line's worst
    turn."""
    config, shape = plan.config, plan.shape
    if not uses_tools(config, tools):
        return
    host = plan.devices["host"]
    host.add("TRL's chat-template utilities (tools)", TOOLS_IMPORTS, "measured, not modelled")
    if config.generator.own_weights or config.placement.learner != "cpu" or config.placement.learner_procs > 1:
        return
    turns = worst_turns(config)
    terms = [turn_bytes(shape, config, t) for t in turns]
    top = max(range(len(turns)), key=lambda k: (terms[k]["peak"], k))  # (the last of equals)
    if plan.turns:
        plan.turns += f"; the rollout planned at its worst turn, {turns[top].number}"
    # the KV cache and logits step lines hold the last turn's decoding; a turn's prefill may pass them
    decoding = terms[-1]["kv"] + terms[-1]["step"]
    k = max(range(len(turns)), key=lambda k: (terms[k]["at_prefill"], k))  # (the last of equals)
    worst, excess = turns[k], terms[k]["at_prefill"] - decoding
    prefill = (
        f"worst at turn {worst.number}: {worst.rows} rows prefilling {worst.prefill} tokens over {worst.context}, "
        f"one layer's activations and the padding mask ({terms[k]['prefill'] / MiB:.1f} MiB) beside the KV cache so far"
    )
    for item in host.items:
        if item.what == "generation KV cache":
            item.note += f"; worst at the last turn, {turns[-1].number}"
        elif item.what == "generation logits step":
            item.note += f"; every turn alike{f' (a turn prefill below them, {prefill})' if excess <= 0 else ''}"
    if excess > 0:  # why the excess alone: a prefill is freed before its decoding steps and their grown KV cache
        host.add("turn prefill beyond the logits step", excess, f"{prefill}, freed before the decoding step",
                 phase="rollout")  # fmt: skip


def turns_line(config, tools: Optional[bool] = None) -> Optional[str]:
    """The plan's line on the turns (None without tools: `tools` None reads generator.tools/environment_factory)."""
    gen = config.generator
    if not uses_tools(config, tools):
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
        f"multi-turn rollout: at most {last} turns (generator.max_tool_calling_iterations {last - 1} + 1); the "
        f"rollout's peak is its worst turn's: the KV cache at its worst at the last, turn {last}, of the prompt and "
        f"the whole trajectory budget ({budget} tokens, tool results included); a tool result {result}; a turn after "
        f"the first prefills {prefill}"
    )
