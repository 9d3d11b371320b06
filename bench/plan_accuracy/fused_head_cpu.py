"""Peak host memory of TRL's fused log-prob head vs a naive full log-softmax, on the CPU.

On CUDA TRL's head folds [4096 x 32768] tiles with Triton; on the CPU it falls back to torch
ops that make tile-sized temporaries. This measures the RSS peak (sampled every 2 ms) of a
forward + backward of each, in tiles of the fused head, which is the factor the planner uses
for a CPU learner (planner/estimate.py HEAD_TILES["cpu"]).

    .venv/bin/python bench/plan_accuracy/fused_head_cpu.py
"""

from __future__ import annotations

import argparse
import gc
import threading
import time
import warnings


def peak_mib(fn) -> float:
    import psutil

    process, stop, peak = psutil.Process(), threading.Event(), [0]

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)

    gc.collect()
    base = peak[0] = process.memory_info().rss
    thread = threading.Thread(target=watch)
    thread.start()
    fn()
    stop.set()
    thread.join()
    return (peak[0] - base) / 2**20


def main() -> None:
    import torch
    from trl.kernels import ChunkedLogProbFunction

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, requires_grad=True)
    weight = torch.randn(args.vocab, args.hidden) * 0.02
    targets = torch.randint(0, args.vocab, (args.tokens,))

    def fused():
        out = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 32768, None, 1.0, ("log_probs",))
        out[0].sum().backward()
        hidden.grad = None

    def naive():
        logits = (hidden @ weight.T).float()
        torch.log_softmax(logits, -1).gather(-1, targets[:, None]).sum().backward()
        hidden.grad = None

    tile = min(args.tokens, 4096) * min(args.vocab, 32768) * 4 / 2**20
    fused_peak = sorted(peak_mib(fused) for _ in range(args.repeats))[args.repeats // 2]
    naive_peak = sorted(peak_mib(naive) for _ in range(args.repeats))[args.repeats // 2]
    print(
        f"| {args.tokens} x {args.vocab} (hidden {args.hidden}) | {tile:.0f} "
        f"| {fused_peak:.0f} ({fused_peak / tile:.1f} tiles) "
        f"| {naive_peak:.0f} ({naive_peak / tile:.1f} tiles) |"
    )


if __name__ == "__main__":
    main()
