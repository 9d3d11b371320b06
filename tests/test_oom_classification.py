"""A CUDA OOM in backward can reach Python as another exception: on an H100 it came out of `loss.backward()` as
`SystemError: <built-in method run_backward ...> returned NULL without setting an exception` (issue 33), neither one
line nor rolled back. torch's allocator counts every OOM (`torch.cuda.memory_stats()["num_ooms"]`), so a phase whose
count rose failed of an OOM, whatever exception arrived. On the CPU the count is a stub (memory.oom.cuda_oom_count),
and the SystemError is raised where the GPU raised it: from the loss's backward."""

from __future__ import annotations

import pytest
import torch

from grpo_lab import LabError
from grpo_lab.memory import oom

GPU_ERROR = "<built-in method run_backward of torch._C._EngineBase object> returned NULL without setting an exception"


def state(lab) -> dict:
    """The LoRA weights and every AdamW tensor, cloned."""
    out = {n: p.detach().clone() for n, p in lab.learner.trainable_parameters().items()}
    for i, s in enumerate(lab.learner.optimizer.state.values()):
        out.update({f"adam{i}.{k}": v.detach().clone() for k, v in s.items() if torch.is_tensor(v)})
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def failing_backward(monkeypatch):
    """The next loss.backward() raises the GPU's SystemError; `counted` says whether the allocator counted an OOM."""
    count = {"ooms": 0}
    monkeypatch.setattr(oom, "cuda_oom_count", lambda device: count["ooms"])
    real = torch.Tensor.backward

    def arm(counted: bool):
        def failing(self, *args, **kwargs):
            monkeypatch.setattr(torch.Tensor, "backward", real)  # once: the retry runs the real backward
            count["ooms"] += counted
            raise SystemError(GPU_ERROR)

        monkeypatch.setattr(torch.Tensor, "backward", failing)

    return arm


def test_an_error_in_backward_is_an_oom_when_the_allocator_counted_one(loaded_lab, failing_backward):
    lab = loaded_lab()
    lab.step()
    before = state(lab)
    failing_backward(counted=True)
    with pytest.raises(LabError) as err:
        lab.step()
    message = str(err.value)
    assert message.startswith("out of memory in phase 'backward' of step 1 on cpu") and "\n" not in message
    assert "torch's allocator counted it" in message and err.value.__cause__ is None
    assert same(state(lab), before)  # the LoRA and AdamW state bit for bit
    assert lab.step().attempts == 2  # the retry runs


def test_the_same_error_with_no_oom_counted_stays_itself(loaded_lab, failing_backward):
    lab = loaded_lab()
    lab.step()
    before = state(lab)
    failing_backward(counted=False)
    with pytest.raises(SystemError, match="returned NULL"):
        lab.step()
    assert same(state(lab), before)  # any failure is rolled back; only an OOM is turned into one line
    assert lab.step().attempts == 2


def test_off_cuda_the_count_is_zero():
    assert oom.cuda_oom_count("cpu") == 0
