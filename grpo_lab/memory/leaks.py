"""Leak detection: a device whose after-step memory grows by about the same amount at (nearly) every step of a
window is flagged ("memory creeping up every step" is a recurring GRPO report). Warm-up is told apart by its shape,
not by a step count: it comes as jumps and flattens, a leak grows step after step (the rule and its numbers below)."""

from __future__ import annotations

import statistics
from collections import defaultdict

from .readers import MiB, is_host

# the after-step figure watched on each kind of device
WATCHED = {"host": "rss", "cuda": "allocated"}
# a leak's later steps grow at least this fraction of its earlier ones: warm-up decays faster (see LeakDetector)
SUSTAINED = 0.5


class LeakDetector:
    """Flags a device when, over its last `window` step-to-step changes of after-step memory, all three hold:
    - most rise (`rising_fraction`, 0.8: one flat step in five is forgiven);
    - the mean and the median change are at least `min_growth_per_step` (4 MiB): the window grows, and so does its
      typical step, so one jump cannot carry the window, as it carried a test on the mean alone;
    - the growth is sustained: the later half of the window grows at least SUSTAINED (half) as much per step as the
      earlier half; warm-up shrinking by more than ~20% a step (0.79**3 = 0.5 over a window of 5) is not a leak.
    Measured after-step host RSS (MiB; 2-core CPU, the built-in tiny models, tests/test_leaks.py):
    - quickstart, 7 steps, flagged before: 687.5 688.1 717.4 717.6 717.9 718.1 718.2, changes 0.6 29.3 0.2 0.3 0.2
      0.1: one 29 MiB jump (the cells between steps 1 and 2: matplotlib's first import and figure alone measure
      +31 MiB), then 0.1-0.3 a step. Mean change 6.0 (flagged), median 0.3 (not);
    - the same notebook run to 25 steps: 0.1-0.4 a step after the jump (722.8 at step 25); `grpo-lab run tiny-demo`
      (25 steps): 604.9 -> 608.2, 0.0-0.7 a step; a plain tiny Lab: 608.1 -> 609.3 over 25 steps. Noise floor
      under 1 MiB a step, so 4 MiB stays the default;
    - a planted leak (an 8 MiB tensor kept per step): 8.0-8.1 a step, every step: flagged at the first full window."""

    def __init__(self, window: int = 5, min_growth_per_step: float = 4 * MiB, rising_fraction: float = 0.8):
        self.window, self.min_growth, self.rising_fraction = window, min_growth_per_step, rising_fraction
        self.history: dict[str, list[float]] = defaultdict(list)

    def observe(self, end_of_step: dict[str, float]) -> list[str]:
        """Record each device's after-step memory; return the devices that look like they leak."""
        flagged = []
        for device, value in end_of_step.items():
            series = self.history[device]
            series.append(value)
            if len(series) > self.window and self.looks_like_a_leak(series[-(self.window + 1) :]):
                flagged.append(device)
        return flagged

    def looks_like_a_leak(self, recent: list[float]) -> bool:
        """The rule above, on `window + 1` after-step figures."""
        changes = [b - a for a, b in zip(recent, recent[1:])]
        half = max(1, len(changes) // 2)
        rising = sum(c > 0 for c in changes) / len(changes)
        earlier, later = sum(changes[:half]) / half, sum(changes[-half:]) / half
        return (
            rising >= self.rising_fraction
            and min(statistics.mean(changes), statistics.median(changes)) >= self.min_growth
            and later >= SUSTAINED * earlier
        )


def end_of_step(rows: list[dict]) -> dict[str, float]:
    """Each device's watched figure at the end of the step's last phase."""
    out = {}
    for r in rows:
        kind = "host" if is_host(r["device"]) else "cuda"
        if r["metric"] == WATCHED[kind]:
            out[r["device"]] = r["end"]
    return out
