"""Every CUDA path CPU CI cannot run, in one command: one line per path (ok / failed / skipped, and why).

    python -m bench.gpu.gpu_smoke       # exit 1 if a path failed; 0 if each is ok or skipped (a CPU: every one skipped)

Run it first on any machine with a GPU (README "CPU vs GPU"; docs/benchmarks.md keeps the last result). The paths:
the learner on cuda:0 with the HF generator; NVML rows read by UUID under a remapped CUDA_VISIBLE_DEVICES; a real
CUDA OOM rolled back, with its allocator snapshot; the CUDA RNG round trip in a checkpoint; 2 NCCL ranks (with 2
GPUs); vLLM sleep/wake (with vLLM). tests/test_gpu.py runs the same functions as `gpu`-marked tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable

MiB = 1024**2


class Skip(Exception):
    """This path cannot run here; the message says why."""


def tiny(**sections) -> dict:
    """The built-in tiny model on cuda:0 (4-bit when bitsandbytes has a CUDA build here)."""
    cfg = {
        "model": {"name_or_path": "builtin:tiny-qwen2"},
        "placement": {"learner": "cuda:0"},
        "generator": {"backend": "hf", "max_completion_length": 16},
        "grpo": {"num_generations": 4, "prompts_per_step": 2, "beta": 0.04},
    }
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        cfg["model"]["load_in_4bit"] = False  # the device's image may lack it: bf16 then, said in the line
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def need_gpus(n: int = 1) -> None:
    import torch

    if not torch.cuda.is_available():
        raise Skip("no CUDA device here")
    if torch.cuda.device_count() < n:
        raise Skip(f"needs {n} GPUs, this machine has {torch.cuda.device_count()}")


def learner_on_cuda() -> str:
    """One step with the learner on cuda:0 and the HF generator: the learner check, the sampler's rows, NVTX."""
    need_gpus()
    from grpo_lab import Lab

    lab = Lab(tiny()).load()
    try:
        result = lab.step()
        rows = [r for r in result.memory if r["device"] == "cuda:0" and r["metric"] == "allocated"]
        assert rows and max(r["peak"] for r in rows) > 0, "no cuda:0 rows"
        quant = "nf4" if lab.config.model.load_in_4bit else "bf16 (no bitsandbytes)"
        return (
            f"step 0 loss {result.loss:+.4f}, {quant}, "
            f"cuda:0 backward peak {max(r['peak'] for r in rows) / MiB:.0f} MiB"
        )
    finally:
        lab.close()


def nvml_by_uuid() -> str:
    """NVML's handle for torch's cuda:0 under CUDA_VISIBLE_DEVICES=<the last GPU>: the same UUID (NVML ignores the
    variable; its index 0 is physical GPU 0)."""
    need_gpus()
    import torch

    last = torch.cuda.device_count() - 1
    code = (
        "import torch, pynvml; from grpo_lab.runtime import nvml_handle; h = nvml_handle(0); "
        "u = pynvml.nvmlDeviceGetUUID(h); u = u.decode() if isinstance(u, bytes) else u; "
        "print(u, str(torch.cuda.get_device_properties(0).uuid))"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(last))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise AssertionError(out.stderr.strip().splitlines()[-1])
    nvml_uuid, torch_uuid = out.stdout.split()
    assert nvml_uuid.lower().removeprefix("gpu-") == torch_uuid.lower().removeprefix("gpu-"), (nvml_uuid, torch_uuid)
    return f"CUDA_VISIBLE_DEVICES={last}: cuda:0 read through NVML as {nvml_uuid}" + (
        " (one GPU: the remap is the identity here)" if last == 0 else ""
    )


def oom_rolled_back(snapshots: bool = True) -> str:
    """A real CUDA OOM in backward (the process capped by set_per_process_memory_fraction): one line, the LoRA and
    AdamW state bit for bit as before the step, an -oom allocator snapshot (with `snapshots`), and the retry runs."""
    need_gpus()
    import torch

    from grpo_lab import Lab
    from grpo_lab.memory.oom import OutOfMemory

    out = Path(tempfile.mkdtemp(prefix="grpo-lab-smoke-"))
    lab = Lab(
        tiny(
            memory={"cuda_snapshots": snapshots},
            run={"output_dir": str(out)},
            grpo={"micro_batch_size": None, "logprob_chunk_size": 8192},
        )
    ).load()
    try:
        lab.step()
        before = lab.inspect()[0]
        used = torch.cuda.memory_allocated(0)
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction((used + 4 * MiB) / total, 0)  # why: any real backward exceeds it
        try:
            lab.step()
            raise AssertionError("no OOM at a cap 4 MiB above what was allocated")
        except OutOfMemory as err:
            line = str(err)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)
        after = lab.inspect()[0]
        assert "\n" not in line and "on cuda:0" in line, line
        assert all(torch.equal(before["lora"][n], after["lora"][n]) for n in before["lora"]), "LoRA changed"
        snaps = sorted(p.name for p in (out / "memory_snapshots").glob("*-oom.pickle")) or ["no snapshot"]
        assert snapshots == (snaps != ["no snapshot"]), f"snapshots {snapshots}, found {snaps}"
        lab.step()
        return f"{line[:400]}; rolled back bit for bit; {snaps[0]}"
    finally:
        lab.close()


# A real CUDA OOM in backward in plain torch (no grpo_lab): which exception reaches Python, with the allocator's
# history on or off and the recompute checkpointed (reentrant or not) through a Python autograd Function, as
# bitsandbytes' 4-bit matmul is. Issue 33: on an H100 the Lab's OOM in backward reached Python as a SystemError.
RAW_OOM = r"""
import sys, torch
from torch.utils.checkpoint import checkpoint
history, mode = sys.argv[1] == "on", sys.argv[2]
class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g
layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(8)).cuda()
x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
block = lambda h, layer: Square.apply(layer(h)) * 0.01
if history:
    torch.cuda.memory._record_memory_history(max_entries=100_000)
h = x
for layer in layers:
    h = block(h, layer) if mode == "none" else checkpoint(block, h, layer, use_reentrant=mode == "reentrant")
loss = h.float().pow(2).mean()
torch.cuda.empty_cache()
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(0) + 4 * 2**20) / total, 0)
try:
    loss.backward()
    print("no-OOM")
except BaseException as err:
    print(type(err).__name__, "num_ooms=%d" % torch.cuda.memory_stats(0).get("num_ooms", 0))
"""


def raw_backward_oom() -> str:
    """Plain torch, one process per case: the exception a real CUDA OOM in backward reaches Python as."""
    need_gpus()
    from concurrent.futures import ThreadPoolExecutor

    cases = [(h, m) for h in ("off", "on") for m in ("none", "nonreentrant", "reentrant")]

    def run(case):
        out = subprocess.run([sys.executable, "-c", RAW_OOM, *case], capture_output=True, text=True, timeout=150)
        said = out.stdout.strip().splitlines()[-1:] or (out.stderr.strip().splitlines()[-1:] or ["no output"])
        return f"history {case[0]}/{case[1]}: {said[0][:80]}"

    with ThreadPoolExecutor(len(cases)) as pool:
        return "; ".join(pool.map(run, cases))


def rng_round_trip() -> str:
    """The CUDA generator of the learner's GPU saved in a checkpoint and restored: the same draws after."""
    need_gpus()
    import torch

    from grpo_lab import Lab

    lab = Lab(tiny()).load()
    try:
        lab.step()
        path = Path(tempfile.mkdtemp(prefix="grpo-lab-smoke-")) / "ckpt"
        lab.save_checkpoint(path)
        a = torch.rand(8, device="cuda:0")
        lab.restore_checkpoint(path)
        b = torch.rand(8, device="cuda:0")
        assert torch.equal(a, b), "CUDA draws differ after restore"
        return "cuda:0's generator restored from the checkpoint: identical draws"
    finally:
        lab.close()


def nccl_ranks() -> str:
    """2 NCCL ranks as Ray actors (a GPU each from the placement group, seen by the rank as its cuda:0): every rank
    starts on its own GPU and a step runs."""
    need_gpus(2)
    try:
        import ray  # noqa: F401
    except ImportError:
        raise Skip("Ray is not installed here (pip install 'grpo-lab[ray]')") from None
    from grpo_lab import Lab

    lab = Lab(tiny(placement={"learner": "cuda:0", "learner_procs": 2})).load()
    try:
        result = lab.step()
        devices = sorted({r["device"] for r in result.memory})
        assert {"rank0/cuda:0", "rank1/cuda:0"} <= set(devices), devices
        return f"step 0 on 2 NCCL ranks, loss {result.loss:+.4f}, rows from {', '.join(devices)}"
    finally:
        lab.close()


def vllm_sleep_wake() -> str:
    """vLLM colocated with sleep mode: a step wakes and sleeps the engine; the ledger's engine layer is 0 asleep."""
    need_gpus()
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise Skip("vLLM is not installed here") from None
    from grpo_lab import Lab

    lab = Lab(
        tiny(
            generator={
                "backend": "vllm",
                "sleep_mode": True,
                "gpu_memory_utilization": 0.3,
                "max_completion_length": 16,
            }
        )
    ).load()
    try:
        result = lab.step()
        assert lab.generator.asleep, "the engine is awake after the step"
        books, resident = lab.generator.engine_share()
        return (
            f"step 0 loss {result.loss:+.4f}; engine books {books / MiB:.0f} MiB, resident asleep {resident / MiB:.0f}"
        )
    finally:
        lab.close()


PATHS: dict[str, Callable[[], str]] = {
    "learner on cuda:0, HF generator": learner_on_cuda,
    "NVML by UUID, remapped devices": nvml_by_uuid,
    "real CUDA OOM rolled back + snapshot": oom_rolled_back,
    "real CUDA OOM rolled back, no snapshots": lambda: oom_rolled_back(snapshots=False),
    "raw torch OOM in backward (cause)": raw_backward_oom,
    "CUDA RNG round trip in a checkpoint": rng_round_trip,
    "2 NCCL ranks": nccl_ranks,
    "vLLM sleep/wake": vllm_sleep_wake,
}


def main() -> int:
    failed = 0
    for name, check in PATHS.items():
        try:
            print(f"{name:<40} ok       {check()}", flush=True)
        except Skip as why:
            print(f"{name:<40} skipped  {why}", flush=True)
        except Exception as err:  # why so broad: one path's failure must not hide the others'
            failed += 1
            where = traceback.extract_tb(err.__traceback__)[-1]
            print(
                f"{name:<40} FAILED   {type(err).__name__}: {str(err).strip()[:200]} "
                f"({Path(where.filename).name}:{where.lineno})",
                flush=True,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
