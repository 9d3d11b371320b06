"""generation/step_heap.py: after it, a CPU rollout's decoding steps' blocks come from the C heap (whose freed top
stays for the next step) instead of maps of their own. Each case runs in a fresh process (glibc's thresholds only
rise within one)."""

import subprocess
import sys

import pytest

STEP = """
import ctypes, sys, torch
from grpo_lab.generation.step_heap import keep_step_pages
libc = ctypes.CDLL(None); libc.sbrk.restype = ctypes.c_void_p
rows, vocab = 8, 151936
if sys.argv[1] == "kept":
    assert keep_step_pages(rows, vocab)
block = torch.empty(2 * rows * vocab * 4, dtype=torch.uint8)  # a step's logits and their copy, in one
top = libc.sbrk(0)
print(top - 2**30 < block.data_ptr() < top)  # on the heap (below its break), not a map of its own
"""


def on_the_heap(mode: str) -> bool:
    done = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True, check=True)
    return done.stdout.split()[-1] == "True"


@pytest.mark.slow  # two fresh processes importing torch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_the_steps_blocks_come_from_the_heap():
    assert not on_the_heap("plain")  # glibc's own threshold: mapped on their own, given back when freed
    assert on_the_heap("kept")


def test_a_step_past_glibcs_rising_threshold_is_left_alone():
    from grpo_lab.generation.step_heap import keep_step_pages

    assert keep_step_pages(8, 151936)
    assert not keep_step_pages(64, 151936)  # 74 MiB: mapped on their own anyway
