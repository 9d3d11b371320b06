"""What the live host guard costs and how far past the line it lets a phase get (grpo_lab/memory/live_guard.py): one
process, tiny-cpu on the random built-in, steps alternated with the live guard on and off (median step seconds each),
then an allocation loop in a reward function (8 MiB a step, no pause) under a budget 256 MiB above the Lab's RSS,
stopped by the live guard: how far past the line (memory.host_threshold x the budget) it got, in MiB and as a share
of the budget.

    python -m bench.probes.live_guard_cost                # 10 steps each way, 5 stops
    python -m bench.probes.live_guard_cost --steps 20 --stops 10

Prints one JSON line per measurement and a summary line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

STEP_MIB = 8


class Hog:
    """A reward function that, when on, allocates host memory STEP_MIB at a time until stopped (or 2 GiB)."""

    def __init__(self):
        self.on, self.reached = False, 0

    def __call__(self, prompts, completions, **kwargs):
        import numpy as np

        if self.on:
            held, self.reached = [], 0
            while self.reached < 2048 * 2**20:
                held.append(np.ones(STEP_MIB * 2**20 // 8))
                self.reached += STEP_MIB * 2**20
        return [0.0 for _ in completions]


def main() -> None:
    from grpo_lab import Lab, load_config
    from grpo_lab.memory.live_guard import LiveGuard
    from grpo_lab.memory.sampler import HostMemoryExceeded
    from grpo_lab.models.source import resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--stops", type=int, default=5)
    args = parser.parse_args()
    hog = Hog()
    config = load_config("tiny-cpu", [f"model.name_or_path={resolve_model_path('builtin:tiny-random')}"])
    lab = Lab(config, reward_funcs=["format", hog]).load()
    lab.step()  # warm-up
    times = {"live": [], "off": []}
    for _ in range(args.steps):
        for way in times:  # why alternated: a machine's drift falls on both ways alike
            lab.memory.live = LiveGuard() if way == "live" else None
            start = time.perf_counter()
            lab.step()
            times[way].append(time.perf_counter() - start)
            print(json.dumps({"way": way, "step_s": round(times[way][-1], 4)}), flush=True)
    lab.memory.live = LiveGuard()
    reader = lab.memory.readers[0]
    past = []
    for _ in range(args.stops):
        reader.budget = reader.read()["rss"] + 256 * 2**20
        line, start = reader.budget * lab.memory.host_threshold, reader.read()["used"]
        hog.on = True
        try:
            lab.step()
        except HostMemoryExceeded:
            pass
        hog.on = False
        over = (start + hog.reached - line) / 2**20
        past.append(over)
        stop = {"stop_past_line_mib": round(over, 1), "budget_mib": round(reader.budget / 2**20)}
        print(json.dumps(stop), flush=True)
        reader.budget = None
        lab.step()  # the step the stop undid
    live, off = statistics.median(times["live"]), statistics.median(times["off"])
    budget = 256 * 2**20 + reader.read()["rss"]
    print(
        json.dumps(
            {
                "summary": True,
                "median_step_s": {"live": round(live, 4), "off": round(off, 4)},
                "step_cost": round(live / off - 1, 4),
                "median_past_line_mib": round(statistics.median(past), 1),
                "max_past_line_share_of_budget": round(max(past) * 2**20 / budget, 4),
            }
        )
    )
    lab.close()


if __name__ == "__main__":
    main()
