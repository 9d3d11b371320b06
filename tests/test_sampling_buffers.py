"""The hf backend's decoding step (grpo_lab/generation/sampling.py DecodeStep: InverseCdfSampler's draw and
SampledLogprobs' record) makes every [vocab]-wide result one row at a time in held [1, vocab] buffers and writes its
choice over the step's scores: seen by torch's profiler, a step's live tensors stay under two rows' width, and the
tokens and log-probs are bit for bit those of the plain formulas over the whole batch (softmax, its float64
cumulative sum, log_softmax), sampled and greedy."""

import torch
from torch.profiler import ProfilerActivity, profile

from grpo_lab.generation.sampling import DecodeStep, InverseCdfSampler, SampledLogprobs
from grpo_lab.generation.step_memory import block_rows

ROWS, VOCAB = 4, 50_000


def step_scores(generator: torch.Generator, filtered: bool) -> torch.Tensor:
    scores = torch.randn(ROWS, VOCAB, generator=generator) * 3
    if filtered:  # (top-k / top-p's -inf)
        scores[:, : VOCAB // 2] = float("-inf")
    return scores


def live_peak(prof) -> int:
    """The profiled CPU allocations replayed in order: the peak of bytes live at once over the start."""
    events = []

    def walk(node):
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    now = peak = 0
    for _, size in sorted(events):
        now += size
        peak = max(peak, now)
    return peak


def test_a_decoding_step_holds_rows_of_the_vocabulary_not_the_batch():
    step = DecodeStep(SampledLogprobs(), InverseCdfSampler(seeds=list(range(ROWS))))
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(ROWS, 1, dtype=torch.long)
    first, later = step_scores(g, False), step_scores(g, False)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof_first:
        out = step(ids, first)
    assert out is first  # (the choice written over the step's scores: no [rows, vocab] result)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof_later:
        step(ids, later)
    # the first step makes the held buffers: a block of rows of the vocabulary in float32 and float64 (2 of the 4
    # rows here, 1 at Qwen2.5's), and a few [rows] scalars
    held = block_rows(VOCAB) * VOCAB * (4 + 8)
    assert block_rows(VOCAB) == 2 and held <= live_peak(prof_first) < held + 64 * 1024, live_peak(prof_first)
    # a later step allocates nothing near one row of the vocabulary ([rows, vocab] float32 was 16 x this bound)
    assert 0 < live_peak(prof_later) < VOCAB, live_peak(prof_later)


def plain(scores: torch.Tensor, u: torch.Tensor):
    """The token and log-prob of each row from the whole batch's softmax, float64 CDF and log_softmax."""
    cdf = torch.cumsum(torch.softmax(scores, dim=-1), dim=-1, dtype=torch.float64)
    token = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=VOCAB - 1)
    return token, torch.log_softmax(scores, dim=-1).gather(-1, token).squeeze(-1)


def test_the_tokens_and_log_probs_are_the_plain_formulas():
    seeds = [11, 12, 13, 14]
    recorder = SampledLogprobs()
    step = DecodeStep(recorder, InverseCdfSampler(seeds=seeds))
    streams = [torch.Generator().manual_seed(s) for s in seeds]
    g = torch.Generator().manual_seed(1)
    ids, expected = torch.zeros(ROWS, 1, dtype=torch.long), []
    for k in range(6):
        scores = step_scores(g, k % 2 == 1)
        u = torch.cat([torch.rand(1, dtype=torch.float64, generator=s) for s in streams])[:, None]
        token, logprob = plain(scores, u)
        out = step(ids, scores.clone())
        assert torch.equal(out.argmax(-1, keepdim=True), token), k
        assert torch.isfinite(out).sum().item() == ROWS
        expected.append(logprob)
        ids = torch.cat([ids, token], 1)
    assert torch.equal(recorder.finish(ids[:, 1:]), torch.stack(expected, 1))
    assert recorder.recorded is None and recorder.count == 0  # (let go once read)


def test_unseeded_draws_take_torchs_stream_and_greedy_the_argmax():
    g = torch.Generator().manual_seed(2)
    scores = step_scores(g, True)
    torch.manual_seed(5)
    u = torch.rand((ROWS, 1), dtype=torch.float64)
    token, logprob = plain(scores, u)
    recorder = SampledLogprobs()
    torch.manual_seed(5)
    assert torch.equal(DecodeStep(recorder, InverseCdfSampler()).__call__(None, scores.clone()).argmax(-1), token[:, 0])
    assert torch.equal(recorder.finish(token), logprob[:, None])
    greedy = SampledLogprobs()
    assert DecodeStep(greedy)(None, scores) is scores  # (greedy: generate()'s argmax over the scores as they are)
    expected = torch.log_softmax(scores, -1).gather(-1, scores.argmax(-1, keepdim=True))
    assert torch.equal(greedy.finish(scores.argmax(-1, keepdim=True)), expected)


def test_generate_holds_no_step_scores_through_the_next_forward(tiny_config):
    """Through transformers' generate() with the hf backend's processors (temperature and top-k written over the
    scores, DecodeStep, its release as a stopping criterion): when a decoding step's forward starts, no [rows, vocab]
    float32 tensor of the last step is alive beside the decoding step's own buffers (generate() kept its logits' copy
    and the processed scores through the forward: one or two more [rows, vocab])."""
    import gc
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessorList, StoppingCriteriaList

    from grpo_lab.config.loading import load_config
    from grpo_lab.generation.hf import sampling_processors

    config = load_config(tiny_config())
    model = AutoModelForCausalLM.from_pretrained(config.model.name_or_path, dtype=torch.float32).eval()
    rows, vocab = 5, model.config.vocab_size
    ids = torch.randint(3, vocab, (rows, 7), generator=torch.Generator().manual_seed(0))
    step = DecodeStep(SampledLogprobs(), InverseCdfSampler(seeds=list(range(rows))))
    held = []  # per decoding forward: the [rows, vocab] float32 tensors alive, less the step's own buffers

    def alive() -> set:
        return {id(o) for o in gc.get_objects() if type(o) is torch.Tensor and tuple(o.shape) == (rows, vocab)}

    before = alive()  # (any left by the tests before this one)

    def count(_, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1:
            held.append(len(alive() - before - {id(step.buffers.row), id(step.buffers.cdf)}))

    request = SimpleNamespace(temperature=0.7, top_k=40, top_p=1.0)
    settings = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    hook = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                generation_config=settings,
                logits_processor=LogitsProcessorList([*sampling_processors(request), step]),
                stopping_criteria=StoppingCriteriaList([step.release]),
            )
    finally:
        hook.remove()
    assert held == [0] * 5, held


def test_a_decoding_step_leaves_no_allocation_alive():
    # why: a small tensor kept per step (the recorder's log-prob column, as it once was) lands in a freed [rows, vocab]
    # block's heap hole at glibc's own mmap threshold, and the rollout's heap then grows by one such block a step
    # (docs/benchmarks.md, "The rollout's heap holes at glibc's own threshold")
    steps, g = 32, torch.Generator().manual_seed(2)
    scores = [step_scores(g, False) for _ in range(steps + 2)]
    ids = torch.zeros(ROWS, 1, dtype=torch.long)
    recorder = SampledLogprobs(steps=steps + 2)
    step = DecodeStep(recorder, InverseCdfSampler(seeds=list(range(ROWS))))
    for s in scores[:2]:  # the first steps: its buffers
        step(ids, s)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for s in scores[2:]:
            step(ids, s)
    assert sum(e.self_cpu_memory_usage for e in prof.events()) == 0  # (bytes allocated less bytes freed)
    assert recorder.finish(ids.expand(-1, steps + 2)).shape == (ROWS, steps + 2)


def test_the_recorded_log_probs_outgrow_their_buffer():
    g = torch.Generator().manual_seed(3)
    scores = [step_scores(g, True) for _ in range(11)]
    recorder = SampledLogprobs(steps=2)  # (grown three times: 2 -> 4 -> 8 -> 16 rows)
    step = DecodeStep(recorder)
    tokens = torch.cat([step(None, s.clone()).argmax(-1, keepdim=True) for s in scores], 1)
    expected = [torch.log_softmax(s, -1).gather(-1, tokens[:, t : t + 1]).squeeze(-1) for t, s in enumerate(scores)]
    got = recorder.finish(tokens)
    assert got.shape == (ROWS, 11) and torch.equal(got, torch.stack(expected, 1))
    assert recorder.recorded is None and recorder.count == 0  # (ready for the next call's rows)


def test_a_gpu_decoding_step_takes_every_row_at_once():
    # why: on a GPU a kernel per row costs launches for bytes the card does not miss; the plan follows each device
    from grpo_lab.generation.step_memory import decode_step_bytes

    assert block_rows(VOCAB, "cuda") is None and block_rows(VOCAB, "cpu") == 2
    assert decode_step_bytes(8, VOCAB, 2, "cuda") == 8 * VOCAB * (2 + 4) + 8 * VOCAB * (4 + 8)
    assert decode_step_bytes(8, VOCAB, 2, "cpu") == 8 * VOCAB * (2 + 4) + 2 * VOCAB * (4 + 8)
    # a CPU step's float32 logits are generate()'s float32 copy too (generation/step_logits.py): one block, not two
    assert decode_step_bytes(8, VOCAB, 4, "cpu") == 8 * VOCAB * 4 + 2 * VOCAB * (4 + 8)
