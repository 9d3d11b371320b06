"""Where the vLLM engine runs and where it writes, without starting one. The devices the user chose, exactly:
`engine_devices` (pure, no GPU needed) maps the placement to the engine's CUDA_VISIBLE_DEVICES and process,
through the user's own CUDA_VISIBLE_DEVICES; preflight refuses what it cannot honour before anything loads.
The adapter directory: RAM-backed when it has room, and nothing left behind by a process that is gone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from grpo_lab import LabError, load_config
from grpo_lab.checks.visible import EngineDevices, engine_devices

UUID_A, UUID_B = "GPU-5f2a9c1e-0b1d-4c1a-9f3e-111111111111", "GPU-8d3b0e2f-1c2e-4d2b-8a4f-222222222222"


@pytest.mark.parametrize(
    "learner, generator, user_cvd, expected",
    [
        # CPU: in-process, nothing pinned
        ("cpu", ["cpu"], None, EngineDevices(None, False, "cpu")),
        ("cuda:0", ["cpu"], "2,3", EngineDevices(None, False, "cuda:0")),
        # colocated on the first visible GPU: in-process lands there by itself
        ("cuda:0", ["cuda:0"], None, EngineDevices(None, False, "cuda:0")),
        ("cuda:0", ["cuda:0"], "2,3", EngineDevices(None, False, "cuda:0")),
        # colocated on another GPU: an in-process engine would take cuda:0, so it gets its own pinned process
        ("cuda:1", ["cuda:1"], None, EngineDevices("1", True, "cuda:1")),
        ("cuda:1", ["cuda:1"], "2,3", EngineDevices("3", True, "cuda:1")),
        # split: generator on its own GPU, the index read through the user's CUDA_VISIBLE_DEVICES
        ("cuda:0", ["cuda:1"], None, EngineDevices("1", True, "cuda:0")),
        ("cuda:0", ["cuda:1"], "2,3", EngineDevices("3", True, "cuda:0")),
        ("cuda:1", ["cuda:0"], "2,3", EngineDevices(None, False, "cuda:1")),
        ("cpu", ["cuda:1"], f"{UUID_A},{UUID_B}", EngineDevices(UUID_B, True, "cpu")),
        # tensor parallel: always its own process, in the order given
        ("cuda:0", ["cuda:1", "cuda:2"], None, EngineDevices("1,2", True, "cuda:0")),
        ("cuda:0", ["cuda:0", "cuda:1"], "2,3", EngineDevices("2,3", True, "cuda:0")),
        ("cuda:2", ["cuda:1", "cuda:0"], "7, 5,6", EngineDevices("5,7", True, "cuda:2")),
        ("cuda:0", ["cuda:0", "cuda:1"], f"{UUID_A},{UUID_B}", EngineDevices(f"{UUID_A},{UUID_B}", True, "cuda:0")),
    ],
)
def test_engine_devices(learner, generator, user_cvd, expected):
    assert engine_devices(learner, generator, user_cvd) == expected


@pytest.mark.parametrize(
    "learner, generator, user_cvd, message",
    [
        (
            "cuda:0",
            ["cuda:2"],
            "2,3",
            r"^placement\.generator: 'cuda:2' is beyond CUDA_VISIBLE_DEVICES='2,3', which makes "
            r"2 GPU\(s\), cuda:0\.\.cuda:1 visible here",
        ),
        ("cuda:2", ["cuda:0"], "2,3", r"^placement\.learner: 'cuda:2' is beyond CUDA_VISIBLE_DEVICES='2,3'"),
        (
            "cuda:0",
            ["cuda:0"],
            "",
            r"^placement\.learner: 'cuda:0' is beyond CUDA_VISIBLE_DEVICES='', which makes no GPU",
        ),
        (
            "cuda:0",
            ["cuda:1"],
            "0,-1,2",
            r"^placement\.generator: 'cuda:1' is beyond CUDA_VISIBLE_DEVICES='0'",
        ),  # CUDA stops at -1
        (
            "cuda:0",
            ["cuda:1", "cuda:1"],
            None,
            r"^placement\.generator: 'cuda:1' is listed twice; list each device once$",
        ),
        ("cpu", ["cpu", "cpu"], None, r"^placement\.generator: 'cpu' is listed twice"),
        ("cpu", ["cpu", "cuda:0"], None, r"^placement\.generator: \['cpu', 'cuda:0'\] mixes 'cpu' with GPUs"),
        ("cpu", ["cuda:0", "cuda:1"], "4,4", r"^placement\.generator: \['cuda:0', 'cuda:1'\] name the same GPU twice"),
    ],
)
def test_engine_devices_refuses_what_it_cannot_honour(learner, generator, user_cvd, message):
    with pytest.raises(LabError, match=message) as err:
        engine_devices(learner, generator, user_cvd)
    assert "\n" not in str(err.value)


def test_preflight_refuses_a_device_beyond_the_users_cuda_visible_devices(tiny_model, monkeypatch):
    """check_devices (which preflight and lab.place run) applies the same rules, before anything loads."""
    from grpo_lab.checks.devices import check_devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cfg = load_config(
        "tiny-cpu", [f"model.name_or_path={tiny_model}", "generator.backend=vllm", "placement.generator=[cpu, cpu]"]
    )
    with pytest.raises(LabError, match=r"^placement\.generator: 'cpu' is listed twice"):
        check_devices(cfg)
    cfg = load_config(
        "tiny-cpu",
        [
            f"model.name_or_path={tiny_model}",
            "generator.backend=vllm",
            "placement.generator=[0]",
            "generator.gpu_memory_utilization=0.5",
        ],
    )
    with pytest.raises(LabError, match=r"^placement\.generator: 'cuda:0' is beyond CUDA_VISIBLE_DEVICES=''"):
        check_devices(cfg)


def vllm_config(tiny_model, *overrides):
    return load_config("tiny-cpu", [f"model.name_or_path={tiny_model}", "generator.backend=vllm", *overrides])


@pytest.mark.parametrize(
    "overrides, environ, expected",
    [
        # the user exported CUDA_VISIBLE_DEVICES=2,3: cuda:1 is physical GPU 3 (it was pinned to "1")
        (
            ["placement.learner=cuda:0", "placement.generator=[1]"],
            {"CUDA_VISIBLE_DEVICES": "2,3"},
            {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "CUDA_VISIBLE_DEVICES": "3"},
        ),
        # colocated on cuda:1: an in-process engine would land on cuda:0 (it ran in-process)
        (
            ["placement.learner=cuda:1", "generator.gpu_memory_utilization=0.3"],
            {},
            {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "CUDA_VISIBLE_DEVICES": "1"},
        ),
        # a user's VLLM_ENABLE_V1_MULTIPROCESSING=0 cannot put a split engine in-process (on the wrong GPU)
        (
            ["placement.learner=cuda:0", "placement.generator=[1, 0]", "generator.gpu_memory_utilization=0.3"],
            {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "CUDA_VISIBLE_DEVICES": "1,0"},
        ),
        # colocated on cuda:0: in-process, the process's own CUDA_VISIBLE_DEVICES untouched (it was set to "0")
        (
            ["placement.learner=cuda:0", "generator.gpu_memory_utilization=0.3"],
            {"CUDA_VISIBLE_DEVICES": "2,3"},
            {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        ),
        # CPU: in-process; a user's export of another variable wins
        ([], {"VLLM_CPU_KVCACHE_SPACE": "4"}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
        ([], {}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}),
    ],
)
def test_the_vllm_engine_env_comes_from_engine_devices(tiny_model, overrides, environ, expected):
    from grpo_lab.generation.vllm_engine import engine_env

    assert engine_env(vllm_config(tiny_model, *overrides), environ) == expected


# --- the adapter directory ----------------------------------------------------------------------

MiB = 1024**2


def test_the_adapter_directory_is_the_first_with_room():
    from grpo_lab.generation.adapter_dirs import choose_adapter_dir

    roomy = [("/dev/shm", 64 * MiB), ("/tmp", 10_000 * MiB)]
    assert choose_adapter_dir(roomy, 40 * MiB) == ("/dev/shm", None)
    where, notice = choose_adapter_dir(roomy, 100 * MiB)  # a container's 64 MB /dev/shm
    assert where == "/tmp"
    assert notice == (
        "generator: /dev/shm has 64 MiB free, under the 100 MiB the LoRA adapter syncs need; "
        "writing them to /tmp instead"
    )
    with pytest.raises(
        LabError,
        match=r"^generator: the LoRA adapter syncs need 20000 MiB free, but /dev/shm has 64 "
        r"MiB and /tmp has 10000 MiB; free space there, or set TMPDIR to a directory "
        r"with room$",
    ):
        choose_adapter_dir(roomy, 20_000 * MiB)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_adapter_directories_of_dead_processes_go_and_live_ones_stay(tmp_path):
    from grpo_lab.generation.adapter_dirs import adapter_dir_prefix, remove_stale_adapter_dirs

    dead, live = dead_pid(), os.getpid()
    stale = tmp_path / f"{adapter_dir_prefix(dead)}abc123"
    kept = [
        tmp_path / f"{adapter_dir_prefix(live)}def456",  # a live process's: never touched
        tmp_path / f"grpo-lab-lora-{dead}-1-ghi789",  # another pid namespace: its pid means nothing here
        tmp_path / "grpo-lab-lora-jkl012",  # no owner recorded: left alone
        tmp_path / "something-else",
    ]
    for path in [stale, *kept]:
        (path / "v1").mkdir(parents=True)
        (path / "v1" / "adapter_model.safetensors").write_bytes(b"x")
    assert remove_stale_adapter_dirs([tmp_path, tmp_path / "missing"]) == [stale]
    assert not stale.exists() and all(path.is_dir() for path in kept)
