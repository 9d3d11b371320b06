"""Leak detection: a device whose after-step memory grows at (nearly) every step over a window
of steps, by more than noise, is flagged ("memory creeping up every step" is a recurring GRPO
report). One step of growth is warm-up; a steady climb is a leak."""

from __future__ import annotations

from collections import defaultdict

from .readers import MiB, is_host

# the after-step figure watched on each kind of device
WATCHED = {"host": "rss", "cuda": "allocated"}


class LeakDetector:
    def __init__(self, window: int = 5, min_growth_per_step: float = 4 * MiB, rising_fraction: float = 0.8):
        self.window, self.min_growth, self.rising_fraction = window, min_growth_per_step, rising_fraction
        self.history: dict[str, list[float]] = defaultdict(list)

    def observe(self, end_of_step: dict[str, float]) -> list[str]:
        """Record each device's after-step memory; return the devices that look like they leak."""
        flagged = []
        for device, value in end_of_step.items():
            series = self.history[device]
            series.append(value)
            recent = series[-(self.window + 1) :]
            if len(recent) <= self.window:
                continue
            steps = list(zip(recent, recent[1:]))
            rising = sum(b > a for a, b in steps) / len(steps)
            growth = (recent[-1] - recent[0]) / self.window
            if rising >= self.rising_fraction and growth >= self.min_growth:
                flagged.append(device)
        return flagged


def end_of_step(rows: list[dict]) -> dict[str, float]:
    """Each device's watched figure at the end of the step's last phase."""
    out = {}
    for r in rows:
        kind = "host" if is_host(r["device"]) else "cuda"
        if r["metric"] == WATCHED[kind]:
            out[r["device"]] = r["end"]
    return out
