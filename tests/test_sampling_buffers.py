"""The hf backend's token draw and log-prob recorder (grpo_lab/generation/sampling.py) write every decoding step's
[sequences, vocab] results into buffers they hold: a step after the first allocates nothing of that width (seen by
torch's profiler), and the tokens and log-probs are bit for bit those of the plain formulas (softmax, its float64
cumulative sum, log_softmax)."""

import torch
from torch.profiler import ProfilerActivity, profile

from grpo_lab.generation.sampling import InverseCdfSampler, SampledLogprobs

ROWS, VOCAB = 4, 50_000


def step_scores(generator: torch.Generator, filtered: bool) -> torch.Tensor:
    scores = torch.randn(ROWS, VOCAB, generator=generator) * 3
    if filtered:  # (top-k / top-p's -inf)
        scores[:, : VOCAB // 2] = float("-inf")
    return scores


def test_a_decoding_step_allocates_no_vocabulary_wide_tensor():
    recorder, sampler = SampledLogprobs(), InverseCdfSampler(seeds=list(range(ROWS)))
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(ROWS, 1, dtype=torch.long)
    ids = sampler(ids, recorder(ids, step_scores(g, False))).argmax(-1, keepdim=True)  # the first step: its buffers
    scores = step_scores(g, False)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        sampler(ids, recorder(ids, scores))
    # each op's own allocations (the bytes it allocated less those it freed: a tensor made inside an op counts)
    sizes = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    assert sizes, "the profiler saw no allocation at all (the step's small tensors are expected)"
    assert max(sizes) < ROWS * VOCAB * 4, sorted(sizes)[-4:]  # (one [rows, vocab] float32 tensor's bytes)


def test_the_tokens_and_log_probs_are_the_plain_formulas():
    seeds = [11, 12, 13, 14]
    recorder, sampler = SampledLogprobs(), InverseCdfSampler(seeds=seeds)
    streams = [torch.Generator().manual_seed(s) for s in seeds]
    g = torch.Generator().manual_seed(1)
    ids, expected_tokens, expected_logprobs = torch.zeros(ROWS, 1, dtype=torch.long), [], []
    for step in range(6):
        scores = step_scores(g, step % 2 == 1)
        cdf = torch.cumsum(torch.softmax(scores, dim=-1), dim=-1, dtype=torch.float64)
        u = torch.cat([torch.rand(1, dtype=torch.float64, generator=s) for s in streams])[:, None] * cdf[:, -1:]
        token = torch.searchsorted(cdf, u, right=True).clamp_(max=VOCAB - 1)
        expected_logprobs.append(torch.log_softmax(scores, dim=-1).gather(-1, token).squeeze(-1))
        out = sampler(ids, recorder(ids, scores))
        assert torch.equal(sampler.cdf, cdf), step
        assert torch.equal(out.argmax(-1, keepdim=True), token), step
        assert torch.isfinite(out).sum().item() == ROWS
        expected_tokens.append(token)
        ids = torch.cat([ids, token], 1)
    got = recorder.finish(ids[:, 1:])
    assert torch.equal(got, torch.stack(expected_logprobs, 1))
    assert recorder.previous is None  # (the last [rows, vocab] log-softmax let go once read)


def recorded_steps(recorder, scores, ids, first: int, last: int):
    for t in range(first, last):
        recorder(ids[:, : t + 1], scores[t])


def test_a_decoding_step_leaves_no_allocation_alive():
    # why: a small tensor kept per step (the recorder's log-prob column, as it once was) lands in a freed [rows, vocab]
    # block's heap hole at glibc's own mmap threshold, and the rollout's heap then grows by one such block a step
    # (docs/benchmarks.md, "The rollout's heap holes at glibc's own threshold")
    steps, g = 32, torch.Generator().manual_seed(2)
    scores = [step_scores(g, False) for _ in range(steps + 2)]
    ids = torch.randint(0, VOCAB, (ROWS, steps + 2), generator=g)
    recorder = SampledLogprobs(steps=steps + 1)
    recorded_steps(recorder, scores, ids, 0, 2)  # the first steps: its buffers
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        recorded_steps(recorder, scores, ids, 2, steps + 2)
    assert sum(e.self_cpu_memory_usage for e in prof.events()) == 0  # (bytes allocated less bytes freed)
    got = recorder.finish(ids[:, 1:])  # (the last call's log-softmax scores no token of these)
    expected = [
        torch.log_softmax(s, -1).gather(-1, ids[:, t + 1 : t + 2]).squeeze(-1) for t, s in enumerate(scores[:-1])
    ]
    assert torch.equal(got, torch.stack(expected, 1))


def test_the_recorded_log_probs_outgrow_their_buffer():
    g = torch.Generator().manual_seed(3)
    scores = [step_scores(g, True) for _ in range(11)]
    ids = torch.randint(VOCAB // 2, VOCAB, (ROWS, 12), generator=g)
    recorder = SampledLogprobs(steps=2)  # (grown twice: 2 -> 4 -> 8 -> 16 columns)
    recorded_steps(recorder, scores, ids, 0, 11)
    got = recorder.finish(ids[:, 1:])
    expected = [torch.log_softmax(s, -1).gather(-1, ids[:, t + 1 : t + 2]).squeeze(-1) for t, s in enumerate(scores)]
    assert got.shape == (ROWS, 11) and torch.equal(got, torch.stack(expected, 1))
    assert recorder.recorded is None and recorder.count == 0  # (ready for the next call's rows)
