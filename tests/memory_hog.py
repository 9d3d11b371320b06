"""Reward functions that misbehave on purpose, importable as 'memory_hog:<name>' (tests/ on the path)."""

_held = []


def leak_20mib(prompts, completions, **kwargs):
    """Keeps 20 MiB alive per call: a leak the detector must flag."""
    _held.append(bytearray(20 * 1024**2))
    return [float(len(c) % 5) for c in completions]
