"""trim_host_heap returns a fragmented heap's free pages to the OS (glibc), as the CPU rollout relies on."""
from __future__ import annotations

import ctypes
import os
import platform

import psutil
import pytest

from grpo_lab.memory.heap import trim_host_heap

MiB = 1024 ** 2


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_returns_the_holes_of_a_fragmented_heap():
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    # 100 KB blocks stay under glibc's 128 KB mmap threshold, so they come from the heap; a 20 KB block kept
    # after each (too big for the free lists Python's start leaves) pins the heap's top, so freeing the big
    # ones leaves holes that free() does not give back
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
    assert before - start > 100 * MiB, "control: free() alone should leave the holes resident"
    assert trim_host_heap()
    released = before - psutil.Process().memory_info().rss
    for pin in pins:
        libc.free(pin)
    assert released > 100 * MiB, f"released {released / MiB:.0f} MiB of ~146 MiB of holes"


# a Lab loads with memory.host_mmap_threshold_mib as configured, then the log-prob head runs forward and backward at
# 1024 rows x a 32,000 vocabulary, 128 rows a chunk (16 MiB float32 + 8 MiB bf16 per chunk: under glibc's 32 MiB
# ceiling, so its rising threshold serves them from the heap); prints RSS's peak over its start / the planned bytes
HEAD_AFTER_LOAD = """
import json, sys, threading, time, psutil, torch
from grpo_lab import Lab
from grpo_lab.head import chunked_logprobs
from grpo_lab.memory.heap import trim_host_heap
from grpo_lab.planner.estimate import chunked_head_bytes
from grpo_lab.planner.shapes import ModelShape
cfg = json.loads(sys.argv[1])
lab = Lab(cfg).load()
V, H, rows, chunk = 32000, 128, 1024, 128
torch.manual_seed(0)
weight = (torch.randn(V, H) * 0.02).bfloat16()
proc, peak, done = psutil.Process(), [0], [False]
def sample():
    while not done[0]:
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.0005)
ratios = []
for _ in range(3):   # why 3: the first pass maps every block; the threshold rises when the first is freed
    trim_host_heap()
    start = peak[0] = proc.memory_info().rss
    done[0] = False
    t = threading.Thread(target=sample)
    t.start()
    hidden = torch.randn(rows, H, dtype=torch.bfloat16, requires_grad=True)
    chunked_logprobs(hidden, weight, None, torch.randint(0, V, (rows,)), 1.0, chunk).sum().backward()
    done[0] = True
    t.join()
    planned = chunk * V * 6   # the head's chunk: float32 logits + the bf16 matmul output (planner/estimate.py)
    ratios.append((peak[0] - start) / planned)
lab.close()
print(json.dumps(ratios))
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's mmap threshold is glibc's")
def test_a_loaded_lab_keeps_the_heads_chunks_out_of_the_heap(tiny_config):
    import json
    import subprocess
    import sys

    def ratios(memory):
        cfg = tiny_config(memory=memory)
        done = subprocess.run([sys.executable, "-c", HEAD_AFTER_LOAD, json.dumps(cfg)], capture_output=True,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    pinned, glibc = ratios({"host_mmap_threshold_mib": 0.125}), ratios({})   # pinned at 128 KiB; the default, glibc's own
    # the planned chunk is what RSS holds once every chunk is mapped on its own (6.2 B/element measured)
    assert max(pinned[1:]) < 1.15, f"RSS over the planned chunk, threshold pinned: {pinned}"
    # control: glibc's own threshold serves the chunks from the heap and keeps their holes (10-19 B/element)
    assert min(glibc[1:]) > 1.4, f"RSS over the planned chunk, glibc's threshold: {glibc}"


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
