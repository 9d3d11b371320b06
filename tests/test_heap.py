"""trim_host_heap returns a fragmented heap's free pages to the OS (glibc), as the CPU rollout relies on."""
from __future__ import annotations

import ctypes
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
