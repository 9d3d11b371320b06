"""Memory sampler overhead: step time with the sampler thread at 20 Hz vs off (and with the live
plot redrawing every 0.5 s), alternated step by step on one loaded Lab; then how long the main
thread stalls while steps run in a worker thread with the sampler and plot running.

Phase-boundary readings happen in every condition (they are the per-phase table); the
conditions differ only in the background threads. Goal: sampler at 20 Hz <= 1% slower.

    .venv/bin/python bench/probes/sampler_overhead.py --rounds 40
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import warnings


def main() -> None:
    from grpo_lab import Lab, load_config
    from grpo_lab.models.tiny import ensure_tiny_model
    from grpo_lab.ui.live import LivePlot

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny-cpu")
    parser.add_argument("--rounds", type=int, default=40, help="rounds of (off, 20 Hz, 20 Hz + plot)")
    parser.add_argument("--hz", type=float, default=20.0)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    cfg = load_config(args.config, ["memory.sample_hz=0", *args.set])
    ensure_tiny_model(cfg.model.name_or_path)
    lab = Lab(cfg).load()
    sampler = lab.memory
    plot = LivePlot(sampler, refresh_s=0.5)
    lab.run(2)  # warm-up

    def timed_step(condition: str) -> float:
        sampler.hz = 0 if condition == "off" else args.hz
        sampler.start()
        if condition == "plot":
            plot.start()
        t0 = time.perf_counter()
        lab.step()
        seconds = time.perf_counter() - t0
        plot.stop()
        sampler.stop()
        return seconds

    times = {"off": [], "sampler": [], "plot": []}
    for _ in range(args.rounds):
        for condition in times:
            times[condition].append(timed_step(condition))
    med = {k: statistics.median(v) for k, v in times.items()}
    pair = lambda k: statistics.median(a / b for a, b in zip(times[k], times["off"]))  # noqa: E731

    # responsiveness: steps in a worker thread (as the notebook panel runs them), main thread ticks every 10 ms
    sampler.hz = args.hz
    sampler.start()
    plot.start()
    worker = threading.Thread(target=lab.run, args=(10,))
    stalls = []
    worker.start()
    while worker.is_alive():
        t0 = time.perf_counter()
        time.sleep(0.01)
        stalls.append(time.perf_counter() - t0 - 0.01)
    plot.stop()
    sampler.stop()

    print(
        f"| {args.config} | {args.rounds} | {med['off']:.4f} | {med['sampler']:.4f} | {pair('sampler'):.4f} | "
        f"{med['plot']:.4f} | {pair('plot'):.4f} | {1000 * statistics.median(stalls):.1f} / {1000 * max(stalls):.1f} |"
    )


if __name__ == "__main__":
    main()
