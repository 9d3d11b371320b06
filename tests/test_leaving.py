"""generator.drop_finished_rows (issue 50): finished rows leave the batch at bucket boundaries, and every row samples
what it samples in one call: the same greedy tokens, the same seeded tokens and log-probs (each row has its own
stream), with rollouts whose lengths differ; and the batch really shrinks."""

from __future__ import annotations

import pytest
import torch

from grpo_lab import ConfigError, Lab, load_config

pytestmark = pytest.mark.xdist_group("leaving")  # why: its tests share one loaded Lab (module-scoped)


@pytest.fixture(scope="module")
def lab(tiny_model):
    """4 prompts x 4, float32."""
    lab = Lab(
        {
            "model": {"name_or_path": tiny_model, "dtype": "float32", "bnb_4bit_compute_dtype": "float32"},
            "generator": {"max_completion_length": 40},
            "grpo": {"num_generations": 4, "prompts_per_step": 4},
        }
    ).load()
    yield lab
    lab.close()


def rollout(lab, leave: bool, temperature: float, monkeypatch, widths: list):
    import grpo_lab.generation.leaving as leaving

    monkeypatch.undo()  # the real criterion, not the previous rollout's counter
    real = leaving.LeaveAtBucket

    def counted(start, eos_ids, threshold):  # one per generate() call: its threshold, half the rows it starts with
        widths.append(threshold)
        return real(start, eos_ids, threshold)

    monkeypatch.setattr(leaving, "LeaveAtBucket", counted)
    length = 40 if temperature == 0 else 200  # (sampled, the random model ends ~2% of its rows a token)
    lab.configure(
        {
            "generator.drop_finished_rows": leave,
            "generator.temperature": temperature,
            "generator.max_completion_length": length,
        }
    )
    torch.manual_seed(0)  # the rows' seeds come from torch's RNG (generation/base.row_seeds)
    return lab.rollout()  # (a restart rewinds the step's prompts: both sample the same ones)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_rows_that_leave_sample_what_one_call_samples(lab, temperature, monkeypatch):
    """Sampled, the random model ends a row with ~10% a token; greedy, its LoRA is moved so that rows end apart."""
    if temperature == 0:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in lab.executor.learner.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    calls_all, calls_leaving = [], []
    whole = rollout(lab, False, temperature, monkeypatch, calls_all)
    leaving = rollout(lab, True, temperature, monkeypatch, calls_leaving)
    lengths = whole.completion_mask.sum(-1)
    assert lengths.unique().numel() >= 3, lengths  # varied lengths: a wrong row kept or dropped would show
    assert calls_all == [-1] and len(calls_leaving) >= 3, calls_leaving  # the batch shrank at least twice
    assert (
        calls_leaving == sorted(set(calls_leaving), reverse=True) and calls_leaving[0] == len(lengths) // 2
    )  # shrinking
    assert torch.equal(leaving.completion_ids, whole.completion_ids)
    assert torch.equal(leaving.completion_mask, whole.completion_mask)
    torch.testing.assert_close(leaving.sampler_logprobs, whole.sampler_logprobs, rtol=0, atol=1e-5)
    lab.configure({"generator.drop_finished_rows": False, "generator.temperature": 1.0})
    with torch.no_grad():
        for name, p in lab.executor.learner.model.named_parameters():
            if "lora_B" in name:
                p.zero_()


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["generator.hf_decode=static"], "decodes 'static' with a static cache"),
        (["generator.backend=vllm", "generator.gpu_memory_utilization=0.3"], "decodes in its own engine"),
    ],
    ids=["static-cache", "vllm"],
)
def test_rows_leaving_a_static_cache_are_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError) as caught:
        load_config("tiny-cpu", [*overrides, "generator.drop_finished_rows=true"])
    message = str(caught.value)
    assert "generator.drop_finished_rows" in message and says in message and "\n" not in message, message
