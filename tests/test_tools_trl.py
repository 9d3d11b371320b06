"""TRL 1.16's own tool loop (GRPOTrainer._tool_call_loop, called with the state it reads) as the oracle of ours: the
same model turns given to both, per row, the same completion ids, tool mask, sampler log-probs, conversation and
tool-call counts; and TRL's own _compute_loss over a tool rollout (its tool mask in) as the oracle of our loss. Only
what TRL and grpo_lab do alike is compared here (tests/test_tools.py covers where we depart: argument checks,
timeouts)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from test_tools import (  # noqa: F401 (tokenizer, forced_call: fixtures)
    TEMPLATE,
    add,
    call_text,
    explode,
    forced_call,
    long_text,
    make_loop,
    tokenizer,
)

from grpo_lab.algo.containers import GenerationRequest, PromptBatch

ANSWER = "<answer>5</answer><|im_end|>"
ADD = call_text("add", '{"a": 2, "b": 3}')
SCENARIOS = {  # each row's turns, in order (its last one repeated)
    "call-then-answer": [ADD, ANSWER],
    "no-call": [ANSWER],
    "raises": [call_text("explode", '{"x": 1}'), ANSWER],
    "unknown-tool": [call_text("nope", '{"x": 1}'), ANSWER],
    "overlong-result": [call_text("long_text", '{"x": 1}'), ANSWER],
    "calls-until-the-bound": [ADD],
    "two-calls-in-a-turn": [ADD.removesuffix("<|im_end|>") + "\n" + ADD, ANSWER],
    "answer-cut-by-the-budget": [ADD, "a long answer " * 20 + ANSWER],
}
BUDGET = 260


def row_turns(tok, prompts: list[list[int]], scripts: list[list[str]]):
    """The model, given: a context's row is the prompt it starts with; its k-th call is that row's k-th turn."""
    count = [0] * len(prompts)

    def turn(context: list[int]) -> list[int]:
        row = next(i for i, p in enumerate(prompts) if context[: len(p)] == p)
        text = scripts[row][min(count[row], len(scripts[row]) - 1)]
        count[row] += 1
        return tok(text, add_special_tokens=False)["input_ids"]

    return turn


def logprobs_of(ids):
    return [-0.25 - 0.001 * t for t in ids]  # (distinct per token, so a misplaced one shows)


def trl_loop(tok, prompts, scripts, tools, iterations):
    """TRL 1.16's _tool_call_loop on these rows: the first turn decoded as TRL decodes it, later turns given."""
    from trl import GRPOTrainer
    from trl.chat_template_utils import parse_response

    turn = row_turns(tok, prompts, scripts)
    first = [turn(p) for p in prompts]

    def generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        ids = [turn(p) for p in prompt_ids]
        return ids, [logprobs_of(i) for i in ids]

    fake = SimpleNamespace(
        processing_class=tok,
        _tokenizer=tok,
        chat_template=None,
        chat_template_kwargs={},
        _is_vlm=False,
        tools=tools,
        environment_factories=None,
        use_vllm=False,
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=10**6)),
        max_completion_length=BUDGET,
        max_tool_calling_iterations=iterations,
        _sync_tool_dicts=[{t.__name__: t for t in tools} for _ in prompts],
        _async_tool_dicts=[{} for _ in prompts],
        _generate_single_turn=generate_single_turn,
    )
    fake._get_tool_suffix_ids = functools.partial(GRPOTrainer._get_tool_suffix_ids, fake)
    completions = [[parse_response(tok, ids, prefix=p, tools=tools)] for p, ids in zip(prompts, first)]
    messages = [[{"role": "user", "content": str(i)}] for i in range(len(prompts))]
    mask, completions, ids, logprobs, calls, failures, _ = GRPOTrainer._tool_call_loop(
        fake, messages, prompts, first, completions, [logprobs_of(i) for i in first], None, {}
    )
    return mask, completions, ids, logprobs, calls, failures


def our_loop(tok, tiny_config, episode, prompts, scripts, tools, iterations):
    from grpo_lab.generation.base import Sample

    loop = episode.loop
    turn = row_turns(tok, prompts, scripts)

    def sample(contexts, rows, request):  # the backend's cut at the request's budget, as generate() cuts
        out = []
        for context in contexts:
            ids = turn(context)[: request.max_completion_length]
            out.append(Sample(ids, logprobs_of(ids), truncated=False))
        return out

    loop.config.generator.max_tool_calling_iterations = iterations
    return episode.run(prompts, range(len(prompts)), sample, GenerationRequest(max_completion_length=BUDGET))


@pytest.mark.parametrize("iterations", [1, 3])
def test_the_tool_loop_is_trls(tokenizer, tiny_config, iterations):  # noqa: F811
    tools = [add, explode, long_text]
    loop = make_loop(tokenizer, tiny_config, tools)
    questions = [f"What is {i} + 3?" for i in range(len(SCENARIOS))]
    batch = PromptBatch(prompts=questions, answers=[None] * len(questions), raw=questions)
    episode = loop.start(batch, 1, GenerationRequest(BUDGET, max_prompt_length=4096))
    rendered = episode.prompts
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rendered]
    scripts = list(SCENARIOS.values())
    mask, completions, ids, logprobs, calls, failures = trl_loop(tokenizer, prompts, scripts, tools, iterations)
    ours = our_loop(tokenizer, tiny_config, episode, prompts, scripts, tools, iterations)
    for name, s, *trl in zip(SCENARIOS, ours, mask, completions, ids, logprobs):
        assert (s.tool_mask, s.messages, s.completion_ids, s.logprobs) == tuple(trl), name
    assert sum(s.tool_calls for s in ours) == calls and sum(s.tool_failures for s in ours) == failures
    assert calls > len(SCENARIOS) // 2 and failures == 2  # (the scenarios call, and fail, as meant)


def by_length(prompts, completions, completion_ids, **kwargs):
    """A reward both sides compute alike (from the token ids), varied within groups."""
    return [float(len(ids) % 5) for ids in completion_ids]


def test_the_loss_over_a_tool_rollout_is_trls(tiny_model, forced_call, tmp_path):  # noqa: F811
    """TRL's own _compute_loss, its tool mask given as rollout_func's env_mask (which TRL treats as its tool_mask),
    on the same model, rollout, advantages and reference log-probs as grpo_lab's backward: the same loss (and KL
    term) and LoRA gradients, both over the model's own tokens only."""
    import torch
    from test_trl_parity import lora_grads, trl_loss_and_grads, trl_trainer

    from grpo_lab import Lab
    from grpo_lab.algo import grpo as phases

    lab = Lab(
        {  # float32 and not 4-bit, as the other loss parity tests (the loss's arithmetic is the same)
            "model": {
                "name_or_path": tiny_model,
                "dtype": "float32",
                "load_in_4bit": False,
                "chat_template": TEMPLATE,
                "gradient_checkpointing": False,
            },
            "lora": {"r": 8, "lora_alpha": 16},
            "grpo": {"beta": 0.04, "prompts_per_step": 2, "num_generations": 2},
            "generator": {"max_completion_length": 130, "max_prompt_length": 1024, "max_tool_calling_iterations": 1},
        },
        reward_funcs=[by_length],
        tools=[add],
    ).load()
    forced_call(lab.learner.tokenizer, ADD)
    rollout = lab.rollout()
    assert (rollout.tool_mask == 0).any() and rollout.tool_calls == [1] * 4
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B != 0: the policy is not the reference, so the KL term is not 0
        for name, p in lab.learner.trainable_parameters().items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    rewards = phases.rewards(rollout, lab.reward_funcs)
    advantages = phases.advantages(rewards, lab.config.grpo.scale_rewards)
    ref = phases.logprobs(lab.learner, lab.reference, rollout, lab.config)
    ours = phases.backward(lab.learner, rollout, advantages, ref, lab.config).stats
    our_grads = lora_grads(lab.learner.model)
    trainer, inputs = trl_trainer(lab, rollout, tmp_path)
    lengths = rollout.completion_lengths.tolist()
    masks = [m[:k] for m, k in zip(rollout.tool_mask.tolist(), lengths)]
    given = trainer.rollout_func
    trainer.rollout_func = lambda prompts, t: {**given(prompts, t), "env_mask": masks}
    batch = trainer._generate_and_score_completions(inputs)
    assert torch.equal(
        batch["tool_mask"].cpu() * batch["completion_mask"].cpu(), rollout.tool_mask * rollout.completion_mask
    )
    torch.testing.assert_close(batch["advantages"].cpu(), advantages.values, rtol=1e-5, atol=1e-6)
    batch["ref_per_token_logps"] = ref.ref
    batch.pop("old_per_token_logps", None)
    theirs, their_grads = trl_loss_and_grads(trainer, lab.learner.model, batch)
    assert ours.loss == pytest.approx(theirs, abs=1e-5) and ours.kl > 0
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, their_grads[name], rtol=1e-4, atol=1e-6)
    lab.close()
