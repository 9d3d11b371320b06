"""What a tool-calling rollout's RSS rise over its start is made of: bench/vs_trl/tool_loop.py's grpo_lab side alone
(builtin:qwen2-152k, 8 rows, every row's tool call forced in each turn but the last), with this process's RSS read
at ~1 kHz by a thread and every sample labelled by what the main thread was in: a turn's prefill forward, a decoding
step's forward, the logits processors between two forwards (the sampler, the log-prob recorder, the forced call),
generate()'s own work around them, the tool calls. Prints one JSON line per rollout: the rollout's rise over its
start (after gc and malloc_trim, as the bench starts it) and, per label, the largest rise seen inside it.

    OMP_NUM_THREADS=1 python -m bench.probes.tool_rollout_rss --turns 2 --length 384
    OMP_NUM_THREADS=1 python -m bench.probes.tool_rollout_rss --turns 2 --length 384 --mmap 0.125   # pinned threshold

docs/benchmarks.md "A tool-calling rollout beside TRL's tool loop" keeps the breakdown.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import threading
import time

MiB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Timeline:
    """RSS samples, each labelled with the main thread's `label` when it was read."""

    def __init__(self, hz: float = 1000):
        self.label, self.peaks, self.period = "idle", {}, 1 / hz
        threading.Thread(target=self.loop, daemon=True).start()

    def loop(self) -> None:
        while True:
            value, label = rss(), self.label
            if value > self.peaks.get(label, 0):
                self.peaks[label] = value
            time.sleep(self.period)

    def set(self, label: str) -> None:
        value = rss()  # (read at every switch too: a short phase between two samples still counts)
        if value > self.peaks.get(self.label, 0):
            self.peaks[self.label] = value
        self.label = label


def instrument(lab, timeline: Timeline) -> None:
    """Labels: `prefill` (a forward of more than one token), `decode` (a one-token forward), `processors` (the logits
    processors after a forward), `generate` (the rest of a generate() call), `tools` (the loop's tool calls)."""
    import grpo_lab.generation.hf as hf

    model = lab.learner.model.get_base_model()  # (PEFT's generate runs the base model's forward)

    def pre(_, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        timeline.set("prefill" if ids is not None and ids.shape[1] > 1 else "decode")

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(lambda *_: timeline.set("processors"))
    original = hf.HFGenerator.generate_once

    def generate_once(self, *args, **kwargs):
        timeline.set("generate")
        try:
            return original(self, *args, **kwargs)
        finally:
            timeline.set("loop")

    hf.HFGenerator.generate_once = generate_once
    marker = lab.generator.turns.marker
    lab.generator.turns.marker = lambda label: (marker(label), timeline.set(label.split()[0]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--length", type=int, default=384)
    parser.add_argument("--mode", default="keep")
    parser.add_argument("--mmap", type=float, default=None, help="memory.host_mmap_threshold_mib")
    parser.add_argument("--rollouts", type=int, default=3)
    args = parser.parse_args(argv)
    import torch

    from bench.probes.turn_cache import force_calls, lookup
    from bench.vs_trl.tool_loop import lab_config, rows
    from grpo_lab import Lab
    from grpo_lab.memory.heap import trim_host_heap

    ns = argparse.Namespace(model="builtin:qwen2-152k", length=args.length, turns=args.turns, generations=4)
    config = lab_config(ns, args.mode) | {"memory": {"host_mmap_threshold_mib": args.mmap}}
    lab = Lab(config, reward_funcs=["length"], train_dataset=rows(), tools=[lookup]).load()
    made = force_calls(lab.learner.tokenizer, args.turns - 1)
    timeline = Timeline()
    instrument(lab, timeline)
    for index in range(1, args.rollouts + 1):
        made.clear()
        torch.manual_seed(1000 + index)
        gc.collect()
        trim_host_heap()
        timeline.set("start")
        base = rss()
        timeline.peaks = {}
        lab.rollout()
        timeline.set("idle")
        peaks = {k: round((v - base) / MiB, 1) for k, v in sorted(timeline.peaks.items(), key=lambda kv: -kv[1])}
        line = {"rollout": index, "turns": args.turns, "mode": args.mode, "mmap": args.mmap,
                "base_mib": round(base / MiB, 1), "rise_mib": max(peaks.values()), "rise_by_label_mib": peaks,
                "after_mib": round((rss() - base) / MiB, 1)}  # fmt: skip
        print(json.dumps(line), flush=True)
    lab.close()


if __name__ == "__main__":
    main()
