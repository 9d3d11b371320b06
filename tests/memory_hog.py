"""Reward functions that misbehave on purpose, importable as 'memory_hog:<name>' (tests/ on the path)."""
import hashlib
import os
from pathlib import Path

_held = []
calls = {"n": 0}


def hog_on_third_call(prompts, completions, **kwargs):
    """Steps 0 and 1 are clean; on step 2 record the saved adapter's hash, then take 3 GiB of host RAM."""
    calls["n"] += 1
    if calls["n"] == 3:
        adapter = Path(os.environ["HOG_RUN_DIR"]) / "adapter" / "adapter_model.safetensors"
        Path(os.environ["HOG_RUN_DIR"], "adapter.sha256").write_text(hashlib.sha256(adapter.read_bytes()).hexdigest())
        _held.append(bytearray(3 * 1024 ** 3))   # zero-filled, so the pages are really touched
    return [float(len(c) % 5) for c in completions]


def leak_20mib(prompts, completions, **kwargs):
    """Keeps 20 MiB alive per call: a leak the detector must flag."""
    _held.append(bytearray(20 * 1024 ** 2))
    return [float(len(c) % 5) for c in completions]
