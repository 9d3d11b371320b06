"""trim_host_heap returns a fragmented heap's free pages to the OS (glibc), as the CPU rollout relies on."""

from __future__ import annotations

import os
import platform

import pytest

MiB = 1024**2


# 100 KB blocks stay under glibc's 128 KB mmap threshold, so they come from the heap; a 20 KB block kept after each
# (too big for the free lists Python's start leaves) pins the heap's top, so freeing the big ones leaves holes that
# free() does not give back; prints [RSS the holes held after free(), RSS the trim released]
FRAGMENT = """
import ctypes, json, psutil
from grpo_lab.memory.heap import trim_host_heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
start = psutil.Process().memory_info().rss
big, pins = [], []
for _ in range(1500):
    block = libc.malloc(100 * 1024)
    ctypes.memset(block, 1, 100 * 1024)   # touch: resident
    big.append(block)
    pins.append(libc.malloc(20000))
for block in big:
    libc.free(block)
before = psutil.Process().memory_info().rss
assert trim_host_heap()
released = before - psutil.Process().memory_info().rss
for pin in pins:
    libc.free(pin)
print(json.dumps([before - start, released]))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_returns_the_holes_of_a_fragmented_heap():
    """In a fresh process: what earlier tests left in this one's free lists would absorb the blocks (it failed after
    test_planner had built the trained tiny model here)."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FRAGMENT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    held, released = json.loads(done.stdout.strip().splitlines()[-1])
    assert held > 100 * MiB, "control: free() alone should leave the holes resident"
    assert released > 100 * MiB, f"released {released / MiB:.0f} MiB of ~146 MiB of holes"


@pytest.mark.slow
# why solo: beside the demo's training runs on the other core (the xdist pass hands slow modules out first) glibc's
# holes in its control read a median of 4.02 against the 3.18 measured alone; the process is its own, the threads'
# interleaving is not (its memory sampler allocates beside the head)
@pytest.mark.solo
@pytest.mark.alone
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's mmap threshold is glibc's")
def test_a_loaded_lab_keeps_the_heads_chunks_at_their_planned_bytes_at_either_threshold(tiny_config):
    """A Lab loads with memory.host_mmap_threshold_mib as configured, then the log-prob head runs forward and backward
    at 1024 rows x a 32,000 vocabulary, 128 rows a chunk (16 MiB float32 + 8 MiB bf16 per chunk: under glibc's 32 MiB
    ceiling, so its rising threshold serves them from the heap): RSS's peak over each pass's start, per chunk element,
    against the 6 bytes the plan counts (float32 logits + the bf16 matmul output)."""
    from bench.plan_accuracy.head_heap import head_passes

    def per_planned(memory):
        passes = head_passes(
            32_000, 128, passes=5, lab_config=tiny_config(memory=memory), env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        return [round(rss / 6, 3) for rss, _ in passes]

    pinned, glibc = per_planned({"host_mmap_threshold_mib": 0.125}), per_planned({})  # 128 KiB; the default (null)
    # pinned: RSS is the live tensors, every chunk mapped on its own (6.1 B/element measured)
    assert max(pinned) < 1.15, f"RSS over the planned chunk, threshold pinned: {pinned}"
    # glibc's own: every chunk of a pass written into the buffers forward made (algo/head.py), so no chunk's freed
    # block is left as a hole (6.1-6.2 B/element measured; a [chunk, V] block allocated per chunk held 8-22, in steps
    # of a third of the 6, so one step over is a failure)
    assert max(glibc) < 1.3, f"RSS over the planned chunk, glibc's threshold: {glibc}"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's mmap threshold is glibc's")
def test_glibcs_own_threshold_after_a_pin_is_refused_in_one_line():
    """A pin cannot be undone (glibc has no way back to its rising threshold), so null after one is refused, not
    silently ignored; another value re-pins. Run in a subprocess: the pin is process-wide."""
    import subprocess
    import sys

    code = """
from grpo_lab.errors import ConfigError
from grpo_lab.memory.heap import pin_mmap_threshold
assert pin_mmap_threshold(None) is False          # nothing pinned yet: glibc's own, nothing to do
assert pin_mmap_threshold(1.0) and pin_mmap_threshold(0.125)
try:
    pin_mmap_threshold(None)
except ConfigError as err:
    print(err)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip()
    assert line.startswith("memory.host_mmap_threshold_mib: null") and "0.125 MiB" in line and "restart" in line, line
    assert "\n" not in line


def test_a_cpu_learner_trims_before_each_layers_full_sequence_forward_only(monkeypatch, tiny_model):
    """At glibc's own threshold (the default) a CPU learner trims the heap as each decoder layer starts a scoring or
    recompute forward (a rollout's prefill too), never on a one-token decode step; a pinned threshold needs none."""
    import torch

    from grpo_lab import load_config
    from grpo_lab.memory import heap
    from grpo_lab.models.fsdp import decoder_layers
    from grpo_lab.models.learner import load_learner

    trims = []
    monkeypatch.setattr(heap, "trim_host_heap", lambda: trims.append(1) or True)
    learner = load_learner(load_config("tiny-cpu", [f"model.name_or_path={tiny_model}"]))
    layers = len(decoder_layers(learner.model))
    ids = torch.randint(3, 200, (2, 9))
    learner.model(input_ids=ids)  # a full-sequence forward: one trim per layer
    assert len(trims) == layers
    trims.clear()
    learner.model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert len(trims) == layers  # the prefill's; none for the 4 decode steps after it
    pinned = load_learner(
        load_config("tiny-cpu", [f"model.name_or_path={tiny_model}", "memory.host_mmap_threshold_mib=1"])
    )
    trims.clear()
    pinned.model(input_ids=ids)
    assert trims == []
