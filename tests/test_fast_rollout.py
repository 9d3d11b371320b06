"""generator.hf_decode: the hf rollout's decode path (issue 33, item 3). `static` preallocates the KV cache for the
whole rollout (transformers' StaticCache: fixed shapes); `compiled` adds CUDA graphs over that decode step
(torch.compile mode reduce-overhead), a GPU's only. With greedy decoding every path gives today's tokens."""

from __future__ import annotations

import pytest
import torch

from grpo_lab import ConfigError, Lab

pytestmark = pytest.mark.xdist_group("fast_rollout")  # why: its tests share module-scoped state: one worker builds it


@pytest.fixture(scope="module")
def lab(tiny_model):
    lab = Lab(
        {
            "model": {"name_or_path": tiny_model, "dtype": "float32", "bnb_4bit_compute_dtype": "float32"},
            "generator": {"max_completion_length": 24, "temperature": 0.0},
            "grpo": {"num_generations": 4, "prompts_per_step": 2},
        }
    ).load()
    yield lab
    lab.close()


def test_the_static_cache_gives_the_plain_paths_greedy_tokens(lab, monkeypatch):
    from transformers import cache_utils

    made = []
    real = cache_utils.StaticCache.__init__

    def counted(self, *args, **kwargs):
        made.append(type(self).__name__)
        real(self, *args, **kwargs)

    monkeypatch.setattr(cache_utils.StaticCache, "__init__", counted)
    lab.configure({"generator.hf_decode": "dynamic"})
    plain = lab.rollout()  # (a restart rewinds the step's prompts: every path samples the same ones)
    assert not made
    lab.configure({"generator.hf_decode": "static"})
    static = lab.rollout()
    assert made, "the static path made no StaticCache"
    assert torch.equal(plain.completion_ids, static.completion_ids)
    assert torch.equal(plain.completion_mask, static.completion_mask)
    torch.testing.assert_close(plain.sampler_logprobs, static.sampler_logprobs, rtol=0, atol=1e-5)


def test_a_static_rollout_decodes_every_chunk_at_one_batch_size_with_the_same_tokens(lab, monkeypatch):
    """A static cache (and on a GPU its CUDA graphs) is built per batch size: 8 rows in chunks of 3 decode as 3, 3 and
    3 (the last filled with copies of its last row, dropped), never a new size for the last chunk; the rows' tokens
    are those of one whole-batch call."""
    from grpo_lab.generation.hf import HFGenerator

    sizes = []
    real = HFGenerator.generate_once

    def watched(self, model, settings, synced, request, samplers, ids, *args):
        sizes.append(ids.shape[0])
        return real(self, model, settings, synced, request, samplers, ids, *args)

    monkeypatch.setattr(HFGenerator, "generate_once", watched)
    lab.configure({"generator.hf_decode": "static", "generator.chunk_size": None})
    whole = lab.rollout()
    assert sizes == [8]
    sizes.clear()
    lab.configure({"generator.chunk_size": 3})
    try:
        chunked = lab.rollout()
    finally:
        lab.configure({"generator.hf_decode": "dynamic", "generator.chunk_size": None})
    assert sizes == [3, 3, 3] and len(chunked) == 8
    sizes.clear()
    lab.configure({"generator.hf_decode": "static", "generator.chunk_size": 16})  # a chunk larger than the batch
    try:
        lab.rollout()
    finally:
        lab.configure({"generator.hf_decode": "dynamic", "generator.chunk_size": None})
    assert sizes == [8]  # one call of the rollout's rows, not padded to 16: the plan's rollout_sequences (issue 68)
    assert torch.equal(whole.completion_ids, chunked.completion_ids)
    torch.testing.assert_close(whole.sampler_logprobs, chunked.sampler_logprobs, rtol=0, atol=1e-5)


def test_a_static_rollout_makes_one_cache_for_all_its_calls_and_its_tensors_stay_put(lab, monkeypatch):
    """transformers builds a StaticCache per generate() call, so the KV tensors moved at every chunk (a CUDA graph
    re-records when a static input's address changes): one per rollout now, reset between its calls, let go after."""
    from transformers import cache_utils

    from grpo_lab.generation.hf import HFGenerator

    made, addresses = [], []
    real_init, real_once = cache_utils.StaticCache.__init__, HFGenerator.generate_once

    def counted(self, *args, **kwargs):
        made.append(self)
        real_init(self, *args, **kwargs)

    def watched(self, *args):
        out = real_once(self, *args)
        if self.static_cache is not None:  # (the dynamic rollout has none)
            addresses.append([layer.keys.data_ptr() for layer in self.static_cache.layers])
        return out

    monkeypatch.setattr(cache_utils.StaticCache, "__init__", counted)
    monkeypatch.setattr(HFGenerator, "generate_once", watched)
    lab.configure({"generator.hf_decode": "dynamic", "generator.chunk_size": None})
    plain = lab.rollout()
    lab.configure({"generator.hf_decode": "static", "generator.chunk_size": 3})
    try:
        static = lab.rollout()
    finally:
        lab.configure({"generator.hf_decode": "dynamic", "generator.chunk_size": None})
    assert len(made) == 1 and len(addresses) == 3  # three calls, one cache
    assert addresses[0] == addresses[1] == addresses[2]  # its tensors stayed put
    assert lab.executor.generator.static_cache is None  # let go after the rollout
    assert torch.equal(plain.completion_ids, static.completion_ids)  # reset between calls: nothing leaks across
    torch.testing.assert_close(plain.sampler_logprobs, static.sampler_logprobs, rtol=0, atol=1e-5)


def test_what_torch_compiled_during_a_rollout_is_in_its_result_and_the_steps_metrics(lab, monkeypatch):
    """torch's own counters (dynamo's unique graphs, CUDA graph trees' recorded inputs), read around the rollout:
    a CPU rollout compiles nothing; one whose calls each compile (forced here through the counters) says so."""
    from torch._dynamo.utils import counters

    from grpo_lab.generation.hf import HFGenerator

    lab.configure({"generator.hf_decode": "dynamic", "generator.chunk_size": 4})
    try:
        assert (lab.rollout().compiled_graphs, lab.rollout().cudagraph_recorded_inputs) == (0, 0)
        real = HFGenerator.generate_once

        def recompiling(self, *args):  # as a GPU rollout whose every call recompiles and re-records
            counters["stats"]["unique_graphs"] += 1
            counters["inductor"]["cudagraph_recorded_non_static_inputs"] += 3
            return real(self, *args)

        monkeypatch.setattr(HFGenerator, "generate_once", recompiling)
        lab.rollout()  # the step's rollout, again (a restart: no update applied yet)
        result = lab.step()  # the rest of the step, on that rollout
    finally:
        lab.configure({"generator.chunk_size": None})
    assert (result.compiled_graphs, result.cudagraph_recorded_inputs) == (2, 6)  # two calls of 4 rows
    metrics = result.metrics()
    assert metrics["compiled_graphs"] == 2 and metrics["cudagraph_recorded_inputs"] == 6


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"generator.hf_decode": "compiled"}, "generator.hf_decode: 'compiled' captures CUDA graphs"),
        ({"generator.backend": "vllm", "generator.hf_decode": "static"}, "generator.hf_decode: backend 'vllm'"),
    ],
)
def test_a_decode_path_that_cannot_run_is_refused_in_one_line(tiny_config, changes, words):
    from grpo_lab import load_config

    cfg = load_config(tiny_config())
    with pytest.raises(ConfigError) as err:
        cfg.update(changes)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_give_the_plain_paths_greedy_tokens(tiny_model):
    lab = Lab(
        {
            "model": {"name_or_path": tiny_model, "dtype": "float32", "bnb_4bit_compute_dtype": "float32"},
            "placement": {"learner": "cuda:0"},
            "generator": {"max_completion_length": 24, "temperature": 0.0},
            "grpo": {"num_generations": 4, "prompts_per_step": 2},
        }
    ).load()
    try:
        plain = lab.rollout()
        lab.configure({"generator.hf_decode": "compiled"})
        compiled = lab.rollout()
        assert torch.equal(plain.completion_ids, compiled.completion_ids)
    finally:
        lab.close()
