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
