"""A training step (forward and backward) through mixture-of-experts layers of Qwen3-30B-A3B's shape (128 experts of
width 768, hidden 2048, top-8; random nf4 weights, double-quantized scales, bfloat16), three ways, each in its own
process: without gradient checkpointing as autograd runs it (each layer's dequantized routed experts kept until
backward), with each layer checkpointed (today's way to fit), and without checkpointing with the experts' backward
dequantizing them again (models/routed_experts.RedequantizedExperts). Prints each one's peak host memory above the
step's start (RSS sampled every millisecond), its seconds, the experts it dequantized, and the goal's ratio: what the
re-dequantizing step holds beyond the checkpointed one, in layers' dequantized experts (goal: at most 1.2); and the
largest difference of the input gradient from autograd's own.

    OMP_NUM_THREADS=1 python -m bench.probes.experts_backward --layers 2 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

MODES = ("kept", "checkpointed", "redequantized")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakRss:
    """The largest RSS seen while it runs, read every millisecond on a thread of its own."""

    def __enter__(self):
        self.peak, self.running = rss(), True
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()
        return self

    def watch(self):
        while self.running:
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss())


def step(layers, hidden, routes, mode: str):
    """Forward through every layer (h + experts(h)) and backward from a squared mean; the input's gradient."""
    from torch.utils.checkpoint import checkpoint

    for experts, _ in layers:
        experts.redequantize = mode == "redequantized"
    h = hidden.detach().requires_grad_(True)
    out = h
    for (experts, _), (index, weights) in zip(layers, routes):
        if mode == "checkpointed":
            out = out + checkpoint(experts, out, index, weights, use_reentrant=False)
        else:
            out = out + experts(out, index, weights)
    out.float().pow(2).mean().backward()
    return h.grad


def run_mode(args) -> dict:
    from bench.probes.routed_experts import one_layer

    torch.manual_seed(0)
    layers = [one_layer() for _ in range(args.layers)]
    config = layers[0][1]
    k, count = config.num_experts_per_tok, config.num_experts
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(args.tokens, config.hidden_size, generator=g, dtype=torch.bfloat16)
    routes = [
        (
            torch.stack([torch.randperm(count, generator=g)[:k] for _ in range(args.tokens)]),  # [tokens, top-k]
            torch.softmax(torch.randn(args.tokens, k, generator=g), -1).to(torch.bfloat16),
        )
        for _ in layers
    ]
    step(layers, hidden, routes, args.mode)  # warm-up: the allocator's and the kernels' first calls
    before_count = sum(e.experts_dequantized for e, _ in layers)
    start = rss()
    with PeakRss() as peak:
        t0 = time.perf_counter()
        grad = step(layers, hidden, routes, args.mode)
        seconds = time.perf_counter() - t0
    torch.save(grad, args.grad)
    routed = [len(torch.unique(index)) for index, _ in routes]
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size * 2  # bytes of one expert in bfloat16
    return {
        "mode": args.mode,
        "peak_above_start": peak.peak - start,
        "seconds": seconds,
        "experts_dequantized": sum(e.experts_dequantized for e, _ in layers) - before_count,
        "layer_experts_bytes": max(routed) * per_expert,  # one layer's routed experts dequantized
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="tokens in the step (each routed to top-8)")
    parser.add_argument("--mode", choices=MODES, help="(one mode, in this process: what main runs for each)")
    parser.add_argument("--grad", help="(with --mode: where the input's gradient goes)")
    args = parser.parse_args(argv)
    if args.mode:
        print(json.dumps(run_mode(args)))
        return
    results, grads = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            grad = str(Path(tmp) / f"{mode}.pt")
            cmd = [sys.executable, "-m", "bench.probes.experts_backward", "--layers", str(args.layers), "--tokens",
                   str(args.tokens), "--mode", mode, "--grad", grad]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results[mode] = json.loads(out.strip().splitlines()[-1])
            grads[mode] = torch.load(grad)
    layer = results["kept"]["layer_experts_bytes"]
    print(f"{args.layers} layers of Qwen3-30B-A3B's experts, {args.tokens} tokens x top-8, bfloat16, nf4")
    print(f"one layer's routed experts dequantized: {layer / 2**30:.3f} GiB")
    for mode, r in results.items():
        print(
            f"{mode:>13}: peak {r['peak_above_start'] / 2**30:.3f} GiB above the step's start "
            f"({r['peak_above_start'] / layer:.2f} layers' experts), {r['seconds']:.2f} s, "
            f"{r['experts_dequantized']} experts dequantized"
        )
    beyond = (results["redequantized"]["peak_above_start"] - results["checkpointed"]["peak_above_start"]) / layer
    print(f"redequantized beyond checkpointed: {beyond:.2f} layers' experts (goal: at most 1.2)")
    for mode in ("checkpointed", "redequantized"):
        diff = (grads[mode].float() - grads["kept"].float()).abs().max().item()
        print(f"input gradient, {mode} vs kept: largest difference {diff:.3e}")


if __name__ == "__main__":
    main()
