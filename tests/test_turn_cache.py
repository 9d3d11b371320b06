"""generator.turn_cache keep (generation/turn_cache.py): a tool loop's turn goes on from the KV cache of the turns
before it, with the same tokens as a full re-prefill (TRL's loop, generator.turn_cache prefill), greedy and seeded
sampling, over several turns whose rows stop at different places and leave between turns. The rows' tool calls are
forced by a logits processor (the tiny random model never writes one), after a free prefix of row-dependent length, so
the rows of a turn end at different columns of the cache."""

from __future__ import annotations

import pytest
import torch

TEMPLATE = "trl:qwen2_5"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
WORDS = [" the", " a", " sum", " of", " two"]  # what a free prefix may use (no special token, no stop)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def forced_turns(monkeypatch, tokenizer, turns: int) -> list:
    """In the tool loop's turn t < `turns` (one generate() call each), the call's row i writes `i % 3` free words then
    the tool call when i % (t + 1) == 0, and writes freely otherwise (so rows stop calling at different turns); later
    turns are free. Returns the turns' (rows, input width) as the model's first forward saw them."""
    import grpo_lab.generation.hf as hf

    call = tokenizer(CALL, add_special_tokens=False)["input_ids"]
    words = [tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in WORDS]
    made: list = []

    class Force:
        def __init__(self, turn: int):
            self.turn, self.start = turn, None

        def __call__(self, input_ids, scores):
            self.start = input_ids.shape[1] if self.start is None else self.start
            pos = input_ids.shape[1] - self.start
            out = scores.clone()
            for i in range(scores.shape[0]):
                if i % (self.turn + 1):
                    continue
                free = i % 3
                if pos < free:  # a free word, the model's choice among WORDS
                    keep = out[i, words].clone()
                    out[i] = -torch.inf
                    out[i, words] = keep
                elif pos - free < len(call):
                    out[i] = -torch.inf
                    out[i, call[pos - free]] = 0.0
            return out

    original = hf.sampling_processors

    def processors(request):
        made.append(request)
        turn = len(made) - 1
        return original(request) + ([Force(turn)] if turn < turns else [])

    monkeypatch.setattr(hf, "sampling_processors", processors)
    return made


def forced_lab(tiny_config, monkeypatch, mode: str, temperature: float, turns: int):
    """A loaded tools Lab of 6 rows (2 prompts x 3) whose every row calls `add` in each of its first `turns` generate()
    calls (forced_turns), going on from its cache or prefilling afresh (`mode`); and the forced calls' record."""
    from grpo_lab import Lab

    cfg = tiny_config(
        model={"chat_template": TEMPLATE},
        generator={
            "max_completion_length": 320,
            "max_prompt_length": 1024,
            "max_tool_calling_iterations": turns,
            "temperature": temperature,
            "turn_cache": mode,
        },
        grpo={"beta": 0.0, "num_generations": 3, "prompts_per_step": 2},
    )
    lab = Lab(cfg, reward_funcs=["length"], tools=[add]).load()
    return lab, forced_turns(monkeypatch, lab.learner.tokenizer, turns)


def rollout(tiny_config, monkeypatch, mode: str, temperature: float, turns: int = 3):
    """One seeded rollout of 6 rows with up to `turns` forced tool turns, and the tokens each forward was fed."""
    lab, _ = forced_lab(tiny_config, monkeypatch, mode, temperature, turns)
    fed = []
    hook = lab.learner.model.get_base_model().model.embed_tokens.register_forward_hook(
        lambda _, args, out: fed.append(args[0].numel())
    )
    torch.manual_seed(7)
    try:
        out = lab.rollout()
    finally:
        hook.remove()
        lab.close()
    return out, sum(fed)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_turn_going_on_from_its_cache_samples_what_a_reprefill_samples(tiny_config, monkeypatch, temperature):
    kept, kept_fed = rollout(tiny_config, monkeypatch, "keep", temperature)
    monkeypatch.undo()
    again, again_fed = rollout(tiny_config, monkeypatch, "prefill", temperature)
    assert kept.turns == again.turns and max(kept.turns) >= 3 and min(kept.turns) < max(kept.turns)
    assert torch.equal(kept.completion_ids, again.completion_ids)
    assert torch.equal(kept.completion_mask, again.completion_mask)
    assert torch.equal(kept.tool_mask, again.tool_mask)
    assert kept.conversations == again.conversations
    torch.testing.assert_close(kept.sampler_logprobs, again.sampler_logprobs, atol=1e-4, rtol=0)
    # the later turns fed the model their new tokens only, not the conversation again
    assert kept_fed < 0.7 * again_fed, (kept_fed, again_fed)


def test_max_tool_response_tokens_cuts_a_tool_result(tiny_model, tiny_config):
    from test_tools import call_text, long_text, make_loop, run
    from transformers import AutoTokenizer

    from grpo_lab.tools.template import prepare_for_tools, use_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    use_chat_template(tokenizer, TEMPLATE)
    prepare_for_tools(tokenizer)
    turns = [call_text("long_text", '{"x": 1}'), "<answer>5</answer><|im_end|>"]
    unbounded, _ = run(make_loop(tokenizer, tiny_config, [long_text]), tokenizer, turns, budget=300)
    assert unbounded.turns == 1  # the whole result would pass the trajectory budget: left out, the row ends (TRL)
    bounded, _ = run(make_loop(tokenizer, tiny_config, [long_text], max_tool_response_tokens=20), tokenizer, turns, 300)
    result = bounded.messages[1]
    assert result["role"] == "tool" and result["content"].startswith("word word")
    assert 0 < len(tokenizer(result["content"], add_special_tokens=False)["input_ids"]) <= 20
    assert bounded.turns == 2 and bounded.messages[-1]["content"] == "<answer>5</answer>"


@pytest.mark.parametrize("value", [0, -3])
def test_a_tool_result_bound_not_above_0_is_one_line(tiny_config, value):
    from grpo_lab.config.loading import load_config
    from grpo_lab.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"^generator.max_tool_response_tokens: got {value}; .*greater than 0$"):
        load_config(tiny_config(generator={"max_tool_response_tokens": value}))


def test_a_turn_whose_cache_would_pass_the_planned_kv_prefills_afresh():
    """The cache's columns are the rows' union: when the row that stays used fewer of them than the one that left,
    going on would hold more KV than the plan's prompt + budget; that turn prefills instead."""
    from transformers import DynamicCache

    from grpo_lab.algo.containers import GenerationRequest
    from grpo_lab.generation.turn_cache import TurnCache

    held = TurnCache(0, GenerationRequest(max_completion_length=10, max_prompt_length=4))  # planned: 14 tokens
    held.rows = [0, 1]
    held.sequences = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 11, 0, 0, 0, 0, 0]])  # row 1 stopped
    held.mask = torch.ones(2, 10, dtype=torch.long)
    context = [1, 2, 3, 4, 11, 21, 22, 23]  # row 1's, with its tool result: 8 tokens where the cache has 9 columns

    def ask(new_tokens):
        cache = DynamicCache()
        cache.update(torch.zeros(2, 1, 9, 2), torch.zeros(2, 1, 9, 2), 0)  # 9 cached columns (the last not forwarded)
        held.cache = cache
        fresh = torch.tensor([context]), torch.ones(1, len(context), dtype=torch.long)
        return held.for_rows([1]).inputs([context], *fresh, new_tokens)

    ids, mask, cache = ask(2)  # 9 + 3 new + 2 decoded = 14: within the plan, goes on
    assert cache is not None and ids.shape == (1, 12) and ids[0, 9:].tolist() == [21, 22, 23]
    assert mask[0].tolist() == [1] * 5 + [0] * 4 + [1] * 3  # row 1's columns past its stop masked out
    ids, mask, cache = ask(3)  # 15 > 14, and a prefill's 8 + 3: prefills afresh
    assert cache is None and ids.tolist() == [context] and held.cache is None


@pytest.mark.parametrize("mode", ["keep", "prefill"])
def test_each_turn_s_recorded_shapes_are_what_the_model_s_forwards_saw(tiny_config, monkeypatch, mode):
    """Rollout.turn_shapes, against the forwards spied as bench/plan_accuracy/turn_plan.py spies them (each
    generate() call's forwards, the prefill's those inside transformers' `_prefill`): the rows, the tokens prefilled,
    the KV context after them (the attention mask's width) and the forwards after the prefill; each labelled with its
    turn's mark, in order. Turn 1's prefill of the prompts is fed in chunks of PREFILL_CHUNK tokens on the CPU
    (generation/step_memory.py); a later turn's, going on from the kept cache or afresh, in one forward."""
    from transformers.generation.utils import GenerationMixin

    from grpo_lab.generation.step_memory import PREFILL_CHUNK

    lab, made = forced_lab(tiny_config, monkeypatch, mode, 1.0, 3)
    forwards, inside = [], [False]  # (generate call, in the prefill, rows, tokens fed, mask width)
    prefill = GenerationMixin._prefill

    def prefilling(self, *args, **kwargs):
        inside[0] = True
        try:
            return prefill(self, *args, **kwargs)
        finally:
            inside[0] = False

    def spy(_, args, kwargs):
        ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
        forwards.append((len(made), inside[0], *ids.shape, kwargs["attention_mask"].shape[1]))

    monkeypatch.setattr(GenerationMixin, "_prefill", prefilling)
    hook = lab.learner.model.get_base_model().model.register_forward_pre_hook(spy, with_kwargs=True)
    torch.manual_seed(7)
    try:
        out = lab.rollout()
    finally:
        hook.remove()
        lab.close()
    spied = []
    for call, shape in zip(sorted({f[0] for f in forwards}), out.turn_shapes):
        chunks = [f for f in forwards if f[0] == call and f[1]]
        fed, context = sum(f[3] for f in chunks), chunks[-1][4]
        fresh = fed == context and shape["mark"] == "turn 1"  # (the prompts: chunked; else one forward)
        whole, rest = divmod(fed, PREFILL_CHUNK)
        expected = [PREFILL_CHUNK] * whole + [rest][:rest] if fresh else [fed]
        assert [f[3] for f in chunks] == expected, chunks
        decoded = len([f for f in forwards if f[0] == call and not f[1]])
        spied.append(dict(rows=chunks[0][2], prefill=fed, context=context, decode=decoded))
    assert max(out.turns) >= 3 and len(spied) >= 3
    assert [{k: v for k, v in s.items() if k != "mark"} for s in out.turn_shapes] == spied, (out.turn_shapes, spied)
    numbers = [int(s["mark"].split()[1]) for s in out.turn_shapes]
    assert numbers == sorted(numbers) and set(numbers) == set(range(1, max(out.turns) + 1)), numbers


@pytest.mark.parametrize("mode", ["keep", "prefill"])
def test_a_cpu_turn_s_freed_buffers_leave_the_heap_before_its_tools_run(tiny_config, monkeypatch, mode):
    """The hf backend trims the C heap as each turn's generate() call ends (a CPU learner), so the turn's freed
    [rows, vocab] buffers are not held as heap holes through the tool calls and the next turn's prefill: a trim comes
    between every turn's last forward and its `tools k` mark (per-step trims set to every 10**9 steps)."""
    import grpo_lab.generation.hf as hf

    lab, _ = forced_lab(tiny_config, monkeypatch, mode, 1.0, 2)
    events: list[str] = []
    monkeypatch.setattr(hf, "TRIM_EVERY", 10**9)  # (TrimHeapEvery then trims at a call's first step alone)
    trim = hf.trim_host_heap
    monkeypatch.setattr(hf, "trim_host_heap", lambda: (events.append("trim"), trim())[1])
    marker = lab.generator.turns.marker
    monkeypatch.setattr(lab.generator.turns, "marker", lambda label: (events.append(label), marker(label))[1])
    hook = lab.learner.model.get_base_model().model.register_forward_hook(lambda *_: events.append("forward"))
    torch.manual_seed(7)
    try:
        lab.rollout()
    finally:
        hook.remove()
        lab.close()
    tools = [i for i, e in enumerate(events) if e.startswith("tools")]
    assert tools, events[-5:]
    for i in tools:
        last_forward = max(k for k in range(i) if events[k] == "forward")
        assert "trim" in events[last_forward:i], (events[i], events[last_forward : i + 1])
