"""lab.arm_fault in one process (rank 0): each fault fires once, at a real point of its phase, and the step is put
back as any failure puts it back; bad input is one line. (2 ranks: tests/test_sharded.py.)"""

from __future__ import annotations

import pytest
import torch

from grpo_lab import Lab, LabError
from grpo_lab.errors import NonFinite

pytestmark = pytest.mark.xdist_group("faults")  # why: its tests share module-scoped state: one worker builds it


@pytest.fixture(scope="module")
def lab():
    lab = Lab("tiny-cpu").load()
    yield lab
    lab.close()


def lora(lab) -> dict:
    return {n: p.detach().clone() for n, p in lab.learner.trainable_parameters().items()}


@pytest.mark.parametrize(
    "phase, error, raised",
    [
        ("rollout", "runtime", RuntimeError),
        ("logprobs", "runtime", RuntimeError),  # the reference pass (beta > 0 here): the fault reaches it
        ("backward", "oom", LabError),  # an OOM is one line naming phase and device
        ("backward", "nan", NonFinite),
    ],
)
def test_a_fault_fires_once_inside_its_phase_and_the_step_goes_on(lab, phase, error, raised):
    lab.step()
    before = lora(lab)
    lab.arm_fault(0, phase, error)
    with pytest.raises(raised) as err:
        lab.step()
    assert phase in str(err.value) and "\n" not in str(err.value)
    assert all(torch.equal(p, before[n]) for n, p in lora(lab).items())  # nothing of the step applied
    assert lab.step().attempts == 2  # disarmed: the retry runs


@pytest.mark.parametrize(
    "args, words",
    [
        ((1, "backward"), "arm_fault: rank 1 does not exist; this Lab is one process (rank 0)"),
        ((0, "sync"), "arm_fault: phase 'sync'; faults go into rollout, logprobs, backward"),
        ((0, "backward", "segfault"), "arm_fault: error 'segfault'; use one of oom, runtime, nan, diverge"),
        ((0, "logprobs", "nan"), "arm_fault: error 'nan' poisons a loss, which only backward computes"),
    ],
)
def test_bad_faults_are_one_line(lab, args, words):
    with pytest.raises(LabError) as err:
        lab.arm_fault(*args)
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


def test_a_fault_before_load_is_one_line():
    with pytest.raises(LabError, match="the lab is not loaded; call lab.load"):
        Lab("tiny-cpu").arm_fault(0, "backward")
