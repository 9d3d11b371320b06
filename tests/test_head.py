"""The chunked log-prob head: exact against a naive log_softmax (values and gradients), and never more
than one chunk of logits alive, forward or backward (watched op by op with a dispatch mode)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_lab.algo.head import chunked_logprobs, trl_logprobs


def naive(hidden, weight, bias, targets, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
    return torch.log_softmax(logits.double(), dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)


def problem(m=37, h=16, v=211, bias=True, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, h, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=dtype, requires_grad=True) if bias else None
    targets = torch.randint(0, v, (m,), generator=g)
    return hidden, weight, b, targets


@pytest.mark.parametrize("chunk", [1, 5, 37, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_a_full_log_softmax(chunk, temperature):
    hidden, weight, bias, targets = problem()
    upstream = torch.randn(hidden.shape[0], dtype=torch.float64)
    got = chunked_logprobs(hidden, weight, bias, targets, temperature, chunk)
    grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight, bias))
    want = naive(hidden, weight, bias, targets, temperature)
    want_grads = torch.autograd.grad((want * upstream).sum(), (hidden, weight, bias))
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)  # float32 accumulation inside
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)  # float32 softmax in backward


def test_gradcheck_in_float64_without_bias():
    hidden, weight, _, targets = problem(m=6, h=4, v=9, bias=False)
    f = lambda h, w: chunked_logprobs(h, w, None, targets, 0.9, 4).double()  # noqa: E731
    # why loose: the forward accumulates in float32 by design (as every head does); gradcheck probes with float64 steps
    assert torch.autograd.gradcheck(f, (hidden, weight), eps=1e-3, atol=1e-3, rtol=1e-3)


def test_trl_kernel_gives_the_same_log_probs():
    hidden, weight, bias, targets = problem(dtype=torch.float32)
    ours = chunked_logprobs(hidden, weight, bias, targets, 0.8, 16)
    theirs = trl_logprobs(hidden, weight, bias, targets, 0.8, 16)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op allocates (bytes); views of existing tensors allocate nothing."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr() for a in [*args, *(kwargs or {}).values()] if isinstance(a, torch.Tensor)
        }
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:  # not a view, not in place
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("chunk", [8, 64])
def test_no_tensor_larger_than_one_chunk_of_logits_forward_or_backward(chunk):
    m, h, v = 512, 32, 8192
    hidden, weight, _, targets = problem(m=m, h=h, v=v, bias=False, dtype=torch.float32)
    weight = weight.detach()  # a frozen LM head, as under LoRA
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
    ):
        with LargestTensor() as watch:
            out = chunked_logprobs(hidden, weight, None, targets, 1.0, chunk)
            out.sum().backward()
    one_chunk = chunk * v * 4
    assert watch.largest == one_chunk, (watch.largest, one_chunk)  # a chunk's logits, and nothing bigger
    assert sum(saved) <= (hidden.numel() + weight.numel()) * 4 + m * 16  # hidden, weight, targets, log Z: no logits
    with LargestTensor() as control:  # the watcher does see a full [M, V]: the naive head's
        torch.log_softmax(hidden.detach() @ weight.t(), dim=-1)
    assert control.largest == m * v * 4


def test_a_lora_on_lm_head_is_applied_and_trained_by_the_chunked_head():
    """Bug 9: a LoRA on lm_head was accepted, used by sampling (PEFT's forward), but the chunked head multiplied by
    the base weight only: the adapter's log-probs were wrong and it got no gradient. Now the head applies it, and
    values and every LoRA gradient equal the unchunked reference (PEFT's own forward, full log_softmax)."""
    from grpo_lab import Lab
    from grpo_lab.algo.logprobs import completion_logprobs, rollout_slice

    lab = Lab("tiny-cpu", overrides=["lora.target_modules=[q_proj,lm_head]", "grpo.logprob_chunk_size=7"]).load()
    try:
        model = lab.learner.model
        head = model.get_base_model().lm_head
        with torch.no_grad():  # B != 0: the adapter changes the logits (PEFT initialises B to 0)
            head.lora_B["default"].weight.normal_(0, 0.5)
        rollout = lab.rollout()
        inputs = rollout_slice(rollout, slice(0, 4), lab.learner.device)
        prompt_ids, prompt_mask, completion_ids, completion_mask = inputs
        model.train()
        params = dict(lab.learner.trainable_parameters())
        upstream = torch.randn(completion_ids.shape, generator=torch.Generator().manual_seed(0))

        mask = completion_mask.bool()
        got = completion_logprobs(model, *inputs)
        got_grads = torch.autograd.grad((got * upstream)[mask].sum(), list(params.values()), allow_unused=True)

        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention = torch.cat([prompt_mask, completion_mask], dim=1)
        logits = (
            model(
                input_ids=ids,
                attention_mask=attention,
                position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
                use_cache=False,
            )
            .logits[:, -completion_ids.shape[1] - 1 : -1]
            .float()
        )
        want = torch.log_softmax(logits, -1).gather(2, completion_ids.unsqueeze(2)).squeeze(2) * mask
        want_grads = torch.autograd.grad((want * upstream)[mask].sum(), list(params.values()), allow_unused=True)

        torch.testing.assert_close(got[mask], want[mask], rtol=1e-4, atol=1e-4)
        by_name = dict(zip(params, zip(got_grads, want_grads)))
        head_grads = {n: g for n, g in by_name.items() if "lm_head" in n}
        assert len(head_grads) == 2 and all(g is not None and g.abs().sum() > 0 for g, _ in head_grads.values())
        for name, (g, w) in by_name.items():
            torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-5, msg=name)
    finally:
        lab.close()


@pytest.mark.parametrize("head", ["chunked", "trl", "full"])
def test_every_head_returns_its_own_tensor_not_a_view(head):
    """A sharded rank's scoring method returns the head's output from the FSDP2 root, and FSDP2 warns of a root
    output that is a view (an in-place op on it would skip its pre-backward hook): every head returns a base tensor."""
    from grpo_lab.algo.logprobs import HEADS

    torch.manual_seed(0)
    hidden, weight = torch.randn(7, 16, requires_grad=True), torch.randn(48, 16, requires_grad=True)
    out = HEADS[head](hidden, weight, None, torch.randint(0, 48, (7,)), 1.0, 4)
    assert out.shape == (7,) and out._base is None, (head, out._base is not None)


class ChunkAllocations(TorchDispatchMode):
    """Counts the tensors ops allocate with at least `numel` elements (views and in-place results are not new)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr() for a in [*args, *(kwargs or {}).values()] if isinstance(a, torch.Tensor)
        }
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.count += t.numel() >= self.numel
        return out


def test_each_pass_allocates_its_chunk_buffers_once():
    """Why: a [chunk, V] block allocated per chunk, freed as the next is made, left glibc heap holes at its own mmap
    threshold that the next chunk did not fit (8-22 bytes of RSS per element where the tensors are 6); each pass now
    writes every chunk into its float32 logits buffer and, for a bf16 weight, the matmul's bf16 buffer."""
    m, h, v, chunk = 512, 32, 8192, 64  # 8 chunks a pass
    hidden, weight, _, targets = problem(m=m, h=h, v=v, bias=False, dtype=torch.float32)
    weight = weight.detach().bfloat16()  # a frozen bf16 LM head, as under LoRA
    with ChunkAllocations(chunk * v) as watch:
        chunked_logprobs(hidden, weight, None, targets, 0.7, chunk).sum().backward()
    assert watch.count == 2, watch.count  # the two buffers, made by forward, kept for backward


def reference(hidden, weight, bias, targets, temperature, chunk, upstream):
    """The head's formulas a chunk at a time with a fresh tensor for each step (F.linear(...).float(), dz.to(...)):
    its log-probs and the gradients of (log-probs * upstream).sum()."""
    n, out, log_z = hidden.shape[0], [], []
    for start in range(0, n, chunk):
        h = hidden[start : start + chunk]
        logits = torch.nn.functional.linear(h.to(weight.dtype), weight, bias).float()
        logits = logits.div_(temperature) if temperature != 1.0 else logits
        target = logits.gather(1, targets[start : start + chunk].unsqueeze(1)).squeeze(1)
        top = logits.amax(dim=1)
        log_z.append(top + logits.sub_(top.unsqueeze(1)).exp_().sum(dim=1).log())
        out.append(target - log_z[-1])
    grads = [torch.empty_like(hidden), torch.zeros(weight.shape), None if bias is None else torch.zeros(bias.shape)]
    for i, start in enumerate(range(0, n, chunk)):
        h, g = hidden[start : start + chunk], upstream[start : start + chunk].float().unsqueeze(1)
        dz = torch.nn.functional.linear(h.to(weight.dtype), weight, bias).float()
        dz = dz.div_(temperature) if temperature != 1.0 else dz
        dz = dz.sub_(log_z[i].unsqueeze(1)).exp_().mul_(-g).scatter_add_(1, targets[start : start + chunk, None], g)
        dz = dz.div_(temperature) if temperature != 1.0 else dz
        grads[0][start : start + chunk] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
        grads[1].addmm_(dz.t(), h.float())
        if bias is not None:
            grads[2] += dz.sum(dim=0)
    return torch.cat(out), grads


@pytest.mark.parametrize("dtype,bias,temperature", [(torch.bfloat16, False, 0.7), (torch.float32, True, 1.0)])
def test_the_held_buffers_give_the_same_bits(dtype, bias, temperature):
    hidden, weight, b, targets = problem(m=37, h=16, v=211, bias=bias, dtype=torch.float32)
    hidden, weight = hidden.detach().to(dtype).requires_grad_(), weight.detach().to(dtype).requires_grad_()
    upstream = torch.randn(37)
    got = chunked_logprobs(hidden, weight, b, targets, temperature, 5)  # 8 chunks, the last of 2 rows
    grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight, *([b] if bias else [])))
    with torch.no_grad():
        want, want_grads = reference(hidden, weight, b, targets, temperature, 5, upstream)
    assert torch.equal(got, want)
    assert torch.equal(grads[0], want_grads[0])
    assert torch.equal(grads[1], want_grads[1].to(dtype))
    if bias:
        assert torch.equal(grads[2], want_grads[2])
