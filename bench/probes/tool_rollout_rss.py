"""What a tool-calling rollout's RSS rise over its start is made of: bench/vs_trl/tool_loop.py's grpo_lab side alone
(builtin:qwen2-152k, 8 rows, every row's tool call forced in each turn but the last), with this process's RSS read
at ~1 kHz by a thread and every sample labelled by what the main thread was in: a turn's prefill forward, a decoding
step's forward, the logits processors between two forwards (the sampler, the log-prob recorder, the forced call),
generate()'s own work around them, the tool calls. Prints the RSS after `Lab.load()` against the plan's resident
host memory (and the checkpoint pages in it), then one JSON line per rollout: the rollout's rise over its
start (after gc and malloc_trim, as the bench starts it) and, per label, the largest rise seen inside it.

    OMP_NUM_THREADS=1 python -m bench.probes.tool_rollout_rss --turns 2 --length 384
    OMP_NUM_THREADS=1 python -m bench.probes.tool_rollout_rss --turns 2 --length 384 --mmap 0.125   # pinned threshold
    OMP_NUM_THREADS=1 python -m bench.probes.tool_rollout_rss --profile     # rollout 2's live tensors at their peak
    OMP_NUM_THREADS=1 python -m bench.probes.tool_rollout_rss --first-forward   # a 2-token forward before rollout 1

`--profile`: rollout 2 under torch.profiler(profile_memory=True, record_shapes=True); the CPU allocator's events
replayed in order give the live tensor bytes over the rollout's start and, at their peak, the tensors live then,
grouped by the op that allocated them and its input shapes (one JSON line).

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


def live_at_peak(prof) -> dict:
    """The profiled allocations replayed: the peak of live bytes over the start, and what was live then (MiB by the
    allocating op and its first two inputs' shapes)."""
    nodes = []

    def walk(node, op):
        alloc = type(node.extra_fields).__name__ == "_ExtraFields_Allocation"
        if alloc:
            nodes.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size, op))
        for child in node.children:
            walk(child, op if alloc else node)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, None)
    events = sorted(nodes, key=lambda n: n[0])
    # the whole rollout's peak (turn 1's prefill), and the decoding steps' (the events after the first tenth)
    return {"whole": peak_of(events, 0), "after_first_tenth": peak_of(events, len(events) // 10)}


def peak_of(events: list, start: int) -> dict:
    """The peak of live bytes over the start, among events[start:], and the tensors live then, by allocating op."""
    live, now, peak, at_peak = {}, 0, 0, {}
    for k, (_, ptr, size, op) in enumerate(events):
        if size > 0:
            live[ptr] = (size, op)
        else:
            live.pop(ptr, None)
        now += size
        if k >= start and now > peak:
            peak, at_peak = now, dict(live)
    groups: dict = {}
    for size, op in at_peak.values():
        shapes = [list(getattr(i, "sizes", []) or []) for i in getattr(op.extra_fields, "inputs", [])[:2]] if op else []
        key = f"{op.name if op else '?'} {shapes}"
        groups[key] = groups.get(key, 0) + size
    top = sorted(groups.items(), key=lambda kv: -kv[1])[:12]
    return {"live_peak_mib": round(peak / MiB, 1), "live_at_peak_mib": {k: round(v / MiB, 2) for k, v in top}}


def mapped_rss() -> int:
    """The bytes of mapped checkpoint files (safetensors) resident in this process (/proc/self/smaps' Rss)."""
    from grpo_lab.models.resident import CHECKPOINT_SUFFIXES

    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for row in f:
            fields = row.split()
            if fields and "-" in fields[0] and not fields[0].endswith(":"):
                inside = len(fields) == 6 and fields[5].endswith(CHECKPOINT_SUFFIXES)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def load_line(lab) -> dict:
    """After `Lab.load()` (gc and malloc_trim): RSS against the plan's resident host memory (what it counts before
    any phase: libraries, the base weights, LoRA, AdamW, the tools' imports), and the checkpoint pages in RSS."""
    from grpo_lab.memory.heap import trim_host_heap
    from grpo_lab.planner import plan

    gc.collect()
    trim_host_heap()
    host = plan(lab.config, tools=True).devices["host"]
    weights = next(i.bytes for i in host.items if i.what == "base weights")
    return {"after_load_rss_mib": round(rss() / MiB, 1), "planned_resident_mib": round(host.resident / MiB, 1),
            "load_over_plan": round(rss() / host.resident, 3), "planned_base_weights_mib": round(weights / MiB, 1),
            "checkpoint_pages_in_rss_mib": round(mapped_rss() / MiB, 1)}  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--length", type=int, default=384)
    parser.add_argument("--mode", default="keep")
    parser.add_argument("--mmap", type=float, default=None, help="memory.host_mmap_threshold_mib")
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="rollout 2 profiled: its live tensors at their peak")
    parser.add_argument("--first-forward", action="store_true", help="a 2-token forward before rollout 1 (what of "
                        "rollout 1's rise is the libraries' one-off state of a first forward)")  # fmt: skip
    args = parser.parse_args(argv)
    import torch

    from bench.probes.turn_cache import force_calls, lookup
    from bench.vs_trl.tool_loop import lab_config, rows
    from grpo_lab import Lab
    from grpo_lab.memory.heap import trim_host_heap

    ns = argparse.Namespace(model="builtin:qwen2-152k", length=args.length, turns=args.turns, generations=4)
    config = lab_config(ns, args.mode) | {"memory": {"host_mmap_threshold_mib": args.mmap}}
    lab = Lab(config, reward_funcs=["length"], train_dataset=rows(), tools=[lookup]).load()
    print(json.dumps(load_line(lab)), flush=True)
    if args.first_forward:
        before = rss()
        with torch.no_grad():
            lab.learner.model(input_ids=torch.ones(1, 2, dtype=torch.long))
        gc.collect()
        trim_host_heap()
        print(json.dumps({"first_forward_kept_mib": round((rss() - before) / MiB, 1)}), flush=True)
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
        profiling = args.profile and index == 2
        if profiling:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
                lab.rollout()
            print(json.dumps({"rollout": index, "profiled": True} | live_at_peak(prof)), flush=True)
            continue
        lab.rollout()
        timeline.set("idle")
        peaks = {k: round((v - base) / MiB, 1) for k, v in sorted(timeline.peaks.items(), key=lambda kv: -kv[1])}
        line = {"rollout": index, "turns": args.turns, "mode": args.mode, "mmap": args.mmap,
                "first_forward": args.first_forward, "base_mib": round(base / MiB, 1), "rise_mib": max(peaks.values()),
                "rise_by_label_mib": peaks,
                "after_mib": round((rss() - base) / MiB, 1)}  # fmt: skip
        print(json.dumps(line), flush=True)
    lab.close()


if __name__ == "__main__":
    main()
