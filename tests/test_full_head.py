"""grpo.logprob_head: full, the textbook [tokens, vocab] pass kept for comparison: the same log-probs and gradients
as the chunked head (the kernel alone, and a Lab's backward on one rollout), and planned as FULL_HEAD_FLOAT32_COPIES
float32 [rows, vocab] buffers, far above the chunked head's one chunk."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_dict

import grpo_lab.algo.logprobs as logprobs_module
from grpo_lab import Lab, load_config
from grpo_lab.algo.head import chunked_logprobs, full_logprobs
from grpo_lab.planner import load_shape, plan
from grpo_lab.planner.estimate import FULL_HEAD_FLOAT32_COPIES, HEAD_BYTES, full_head_bytes

pytestmark = pytest.mark.xdist_group("full_head")  # why: its Lab test shares a module-scoped Lab


def problem(rows=150, hidden=32, vocab=1000, seed=0):
    """float32 hidden rows, an LM head with bias and random targets (rows not a multiple of the chunk)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).requires_grad_()
    return h, w, b, torch.randint(0, vocab, (rows,), generator=g)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_full_head_equals_the_chunked_head_in_values_and_gradients(temperature):
    hidden, weight, bias, targets = problem()
    upstream = torch.randn(hidden.shape[0], generator=torch.Generator().manual_seed(1))
    results = []
    for head in (full_logprobs, chunked_logprobs):
        out = head(hidden, weight, bias, targets, temperature, 64)  # 150 rows: chunks of 64, 64 and 22
        results.append((out, torch.autograd.grad((out * upstream).sum(), (hidden, weight, bias))))
    (full, full_grads), (chunked, chunked_grads) = results
    assert full.shape == chunked.shape == (150,) and full.dtype == torch.float32
    torch.testing.assert_close(full, chunked, rtol=1e-5, atol=1e-5)
    for name, got, want in zip(("hidden", "weight", "bias"), full_grads, chunked_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"grad wrt {name}: {m}")


def test_full_is_a_registered_head_and_a_valid_config_value():
    assert logprobs_module.HEADS["full"] is full_logprobs
    assert HEAD_BYTES["full"] is full_head_bytes
    assert load_config("tiny-cpu", ["grpo.logprob_head=full"]).grpo.logprob_head == "full"


def head_item(*overrides):
    """The planned 'log-prob head' of logits-heavy-cpu's host, in its backward (the config too)."""
    cfg = load_config("logits-heavy-cpu", list(overrides))
    items = [i for i in plan(cfg).devices["host"].items if i.what == "log-prob head" and i.phase == "backward"]
    assert len(items) == 1
    return cfg, items[0]


def test_the_full_head_is_planned_as_float32_copies_of_all_logits_far_above_the_chunked_one():
    cfg, full = head_item("grpo.logprob_head=full")
    shape = load_shape(cfg.model.name_or_path)
    rows = cfg.grpo.prompts_per_step * cfg.grpo.num_generations * cfg.generator.max_completion_length
    assert cfg.grpo.micro_batch_size is None and rows == 2048  # the whole batch in one pass
    compute = 2  # bnb_4bit_compute_dtype bfloat16
    assert cfg.model.bnb_4bit_compute_dtype == "bfloat16"
    hidden_term = rows * shape.hidden * 2 * compute  # the hidden rows and their gradient
    assert full.bytes == FULL_HEAD_FLOAT32_COPIES * 4 * rows * shape.vocab + hidden_term
    assert "textbook" in full.note
    _, chunked = head_item("grpo.logprob_head=chunked")
    assert full.bytes > 10 * chunked.bytes


def test_a_plan_the_full_head_breaks_names_the_chunked_head_among_its_fixes():
    """The plan offered only a smaller micro-batch for a step whose textbook head was over the budget (notebook 04's
    plan), never the head itself; the chunked head is the fix that leaves the step's shape alone."""
    over = load_config("logits-heavy-cpu", ["grpo.logprob_head=full", "placement.host_memory_gib=2"])
    p = plan(over)
    assert not p.fits and "grpo.logprob_head: chunked" in p.fixes, p.fixes
    assert plan(load_config(over, ["grpo.logprob_head=chunked"])).fits  # the fix named fits, as named


@pytest.fixture(scope="module")
def head_lab(tiny_model):
    """A float32 tiny Lab sampling at temperature 0.7 with a KL term (the reference pass uses the head too)."""
    lab = Lab(tiny_dict(tiny_model, generator={"temperature": 0.7}, grpo={"beta": 0.04})).load()
    yield lab
    lab.close()


def test_a_lab_with_the_full_head_gives_the_chunked_heads_loss_and_gradients(head_lab, monkeypatch):
    """Backward on one rollout with each head (rolled back in between, as notebooks/04 does): same loss and LoRA
    gradients; the full head was the one called."""
    lab = head_lab
    calls = []
    monkeypatch.setitem(logprobs_module.HEADS, "full", lambda *rows: calls.append(len(rows[0])) or full_logprobs(*rows))
    rollout = lab.rollout()
    advantages = lab.advantages(lab.rewards(rollout))
    advantages.values.copy_(torch.linspace(-1.0, 2.0, len(rollout)))  # why: tied rewards would leave no gradient
    logprobs = lab.logprobs(rollout)
    results = {}
    for head in ("chunked", "full"):
        lab.config.grpo.logprob_head = head  # live: the next backward reads it
        stats = lab.backward(rollout, advantages, logprobs)
        grads = {n: p.grad.clone() for n, p in lab.learner.trainable_parameters().items() if p.grad is not None}
        lab.rollback()  # drop the gradients, apply nothing
        results[head] = (stats.loss, grads)
    assert calls, "the full head was never called"
    (loss, grads), (full_loss, full_grads) = results["chunked"], results["full"]
    assert grads and full_grads.keys() == grads.keys()
    assert any(g.abs().max() > 0 for g in grads.values())
    assert full_loss == pytest.approx(loss, abs=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(full_grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
