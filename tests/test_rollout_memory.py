"""The hf rollout on a large vocabulary holds one step: no allocation bigger than one decoding step's [n, vocab].

Found on Qwen2.5's vocabulary: transformers' prefill scores `hidden[:, -1:, :]`, a strided view; torch's
bfloat16 matmul on the CPU cannot fold it and materialises the LM head broadcast over the batch
([n, hidden, vocab]: 311 MB for 8 sequences at 151,936 x 128), the rollout's largest transient by far.
Watched with torch.profiler's memory events, which see allocations inside kernels too.
"""

from __future__ import annotations

import pytest
from torch.profiler import ProfilerActivity, profile

from grpo_lab import Lab, load_config
from grpo_lab.models.tiny import build_tiny_model

pytestmark = pytest.mark.xdist_group("rollout_memory")  # why: its tests share module-scoped state: one worker builds it

VOCAB = 32768


@pytest.fixture(scope="module")
def wide_vocab_model(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("wide") / "m", vocab_size=VOCAB, eos_probability=None))


def largest_allocation(fn) -> int:
    """Bytes of the largest memory any single op allocated (net, itself and its callees) while `fn` ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rollout_allocates_nothing_larger_than_one_steps_logits(wide_vocab_model, dtype):
    n = 8
    cfg = load_config(
        "tiny-cpu",
        [
            f"model.name_or_path={wide_vocab_model}",
            f"model.dtype={dtype}",
            f"model.bnb_4bit_compute_dtype={dtype}",
            "grpo.prompts_per_step=1",
            f"grpo.num_generations={n}",
            "generator.max_completion_length=4",
        ],
    )
    lab = Lab(cfg).load()
    try:
        lab.rollout()  # warm-up: one-off library allocations
        largest = largest_allocation(lab.rollout)
    finally:
        lab.close()
    step_cdf = n * VOCAB * 8  # one decoding step's [n, vocab] CDF in float64 (the sampler's), the largest buffer
    assert largest <= step_cdf * 1.05, (
        f"largest rollout allocation {largest / 2**20:.1f} MiB > one step's "
        f"[n, vocab] float64 CDF {step_cdf / 2**20:.1f} MiB"
    )
