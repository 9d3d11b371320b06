"""The runtime: "which device am I, whose RNG, who decides" as pure functions of (rank, size, placement), tested with
remapped device lists. A CPU has one device, one RNG and no streams, so these are the CUDA paths' only CPU test;
bench/gpu/gpu_smoke.py runs the same paths on a GPU (the `gpu` tests below are what it runs)."""

from __future__ import annotations

import random

import pytest
import torch

from grpo_lab.config.loading import load_config
from grpo_lab.runtime import (
    Runtime,
    capture_rng,
    nvml_handle,
    nvml_index,
    rank_rng,
    restore_rng,
    runtime,
    set_runtime,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def as_rank():
    """Run a block as rank k of a world of `size` (restored after)."""
    saved = runtime()

    def become(rank: int, size: int = 2) -> Runtime:
        set_runtime(Runtime(rank, size, is_rank=True))
        return runtime()

    yield become
    set_runtime(saved)


def gpu_config(learner="cuda:2", procs=2, **extra):
    sets = [f"placement.learner={learner}", f"placement.learner_procs={procs}"]
    return load_config("tiny-cpu", sets + [f"{k}={v}" for k, v in extra.items()])


# --- which device am I ---


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_rank_k_computes_on_cuda_n_plus_k(rank):
    config = gpu_config("cuda:2", procs=4)
    me = Runtime(rank, 4, is_rank=True)
    assert me.device(config) == f"cuda:{2 + rank}"
    assert me.watched_devices(config) == [f"cuda:{2 + rank}"]  # its own GPU only: no context on the others'
    assert me.cuda_indices(config) == [2 + rank]  # whose RNG: its GPU's alone


def test_the_driver_is_not_a_rank():
    config = gpu_config("cuda:2", procs=4)
    driver = Runtime()
    assert driver.is_driver and not driver.sharded and driver.device(config) == "cuda:2"
    assert Runtime(0, 4, is_rank=True).is_driver is False


def test_a_rank_checks_its_learner_on_its_own_device(as_rank, monkeypatch):
    """Bug 1: every rank checked its parameters against placement.learner, so rank 1's own cuda:N+1 was 'outside the
    plan' and a sharded learner could not start on GPUs."""
    from grpo_lab.execution import local as executor_module

    checked = []
    monkeypatch.setattr(executor_module, "check_learner", lambda model, planned: checked.append(planned))

    class Lab:
        config = gpu_config("cuda:0", procs=2)

    ex = executor_module.LocalExecutor(Lab.config, None, lambda: 0)
    ex.learner = type("Learner", (), {"model": None})()
    as_rank(1)
    ex.check_learner()
    assert checked == [["cuda:1"]]
    assert ex.devices() == ["cuda:1"]  # what its sampler reads, and what its OOM lines name


def test_an_oom_on_a_rank_names_the_ranks_device(as_rank):
    from grpo_lab.memory.oom import as_lab_error

    as_rank(1)
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    line = str(as_lab_error(err, "backward", 3, runtime().device(gpu_config("cuda:0"))))
    assert "on cuda:1" in line


def test_allocator_snapshots_go_to_one_folder_per_rank(as_rank, tmp_path):
    """Bug 8: every rank wrote step{N}-{phase}.pickle into the same run.output_dir."""
    from grpo_lab.execution.local import LocalExecutor

    class Lab:
        config = gpu_config("cuda:0", procs=2, **{"memory.cuda_snapshots": "true", "run.output_dir": str(tmp_path)})

    with pytest.warns(UserWarning, match="no CUDA device"):  # (this CPU: the listener is made, and says it is idle)
        folders = []
        for rank in (0, 1):
            as_rank(rank)
            folders.append(LocalExecutor(Lab.config, None, lambda: 0).listeners()[0].directory)
    assert folders == [tmp_path / "memory_snapshots" / "rank0", tmp_path / "memory_snapshots" / "rank1"]
    assert Runtime().snapshot_dir(str(tmp_path)) == tmp_path / "memory_snapshots"  # one process: as before


# --- NVML by UUID ---


class FakeNVML:
    """NVML's view: physical devices in physical order, whatever CUDA_VISIBLE_DEVICES says."""

    def __init__(self, uuids):
        self.uuids = uuids

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetUUID(self, handle):
        return self.uuids[handle[1]].encode()  # older nvidia-ml-py returns bytes


def test_nvml_handles_are_found_by_uuid_under_a_remapped_device_list():
    """Bug 2: with CUDA_VISIBLE_DEVICES=2,3 torch's cuda:0 is physical GPU 2, and nvmlDeviceGetHandleByIndex(0) read
    physical GPU 0's memory for it."""
    physical = [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(4)]
    nvml = FakeNVML(physical)
    # torch names a device's UUID without NVML's 'GPU-' prefix
    torch_uuid = {0: physical[2].removeprefix("GPU-"), 1: physical[3].removeprefix("GPU-")}
    assert nvml_handle(0, nvml, torch_uuid[0]) == ("handle", 2)
    assert nvml_handle(1, nvml, torch_uuid[1]) == ("handle", 3)
    assert nvml_index("GPU-unknown", physical) is None
    assert nvml_index("MIG-" + physical[1].removeprefix("GPU-"), physical) == 1


# --- whose RNG ---


def draws() -> list:
    return [torch.rand(3).tolist(), random.random()]


def test_each_rank_restores_its_own_rng_from_a_sharded_checkpoint():
    """Bug 3: the checkpoint saved rank 0's states and every rank restored them, so after --resume the ranks'
    streams differed from an uninterrupted run (rank 1 continued rank 0's, on the wrong GPU)."""
    states, expected = [], []
    for rank in (0, 1):  # two ranks whose streams differ (e.g. their GPUs' generators advanced differently)
        torch.manual_seed(100 + rank)
        random.seed(100 + rank)
        states.append(capture_rng([]))
        expected.append(draws())
    saved = {**states[0], "ranks": states}  # what save_full_checkpoint writes (rank 0's for one process too)
    for rank in (0, 1):
        restore_rng(rank_rng(saved, rank, 2))
        assert draws() == expected[rank]
    restore_rng(rank_rng(saved, 0, 1))  # another number of ranks (here one process): rank 0's, equal by construction
    assert draws() == expected[0]
    restore_rng(rank_rng(states[1], 0, 1))  # a one-process checkpoint: its one state
    assert draws() == expected[1]


def test_a_rank_captures_only_its_own_gpus_generator():
    """A rank's boundary state and checkpoint entry hold its GPU's CUDA generator, keyed by index, so restoring it
    never sets another rank's GPU (set_rng_state_all did)."""
    state = capture_rng([])
    assert "cuda" not in state or state["cuda"] == {}


@cuda
@pytest.mark.gpu
def test_cuda_rng_round_trip_per_device():
    torch.cuda.init()
    state = capture_rng([0])
    a = torch.rand(4, device="cuda:0")
    restore_rng(state)
    assert torch.equal(torch.rand(4, device="cuda:0"), a) and list(state["cuda"]) == [0]


@cuda
@pytest.mark.gpu
def test_nvml_handle_by_uuid_on_this_gpu():
    import pynvml

    handle = nvml_handle(0)
    assert handle is not None
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    assert nvml_index(str(torch.cuda.get_device_properties(0).uuid), [uuid]) == 0


# --- who decides ---


def test_a_world_of_one_decides_alone():
    me = Runtime()
    assert me.agree(True) == [0] and me.agree(False) == []
    assert me.rows(8) == slice(0, 8) and Runtime(1, 2, is_rank=True).rows(8) == slice(4, 8)


def test_the_host_guard_runs_once_in_the_driver_never_on_a_rank(as_rank):
    """Bug 5's second half: one rank's own host guard refused a phase on that rank alone while the others blocked in
    a collective. The host is one; the driver's guard stops every rank between phases."""
    from grpo_lab.execution.local import LocalExecutor
    from grpo_lab.memory.sampler import HostMemoryExceeded

    class Lab:
        config = load_config("tiny-cpu", ["memory.host_threshold=0.0001", "memory.sample_hz=0"])

    driver = LocalExecutor(Lab.config, None, lambda: 0).memory_sampler()
    with pytest.raises(HostMemoryExceeded):
        driver.check_host(0, "rollout")
    as_rank(1)
    # a rank: no refusal of its own
    LocalExecutor(Lab.config, None, lambda: 0).memory_sampler().check_host(0, "rollout")
