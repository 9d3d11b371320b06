"""The head, by measurement (issue 49): grpo_lab's chunked log-prob head with its GRPO loss against liger-kernel's
fused linear GRPO loss (`LigerFusedLinearGRPOLoss`), on the same hidden states, LM head and batch, side by side in one
process: the peak resident memory above the start of the pass (Linux's VmHWM, reset before each side through
/proc/self/clear_refs), the seconds of forward + backward, and the loss and gradient differences.

Why the two differ in memory: grpo_lab chunks by tokens (`grpo.logprob_chunk_size` rows of the flattened batch, here
128), liger by sequences (`chunk_size` whole completions), so liger's logits chunk grows with the completion length.

    python -m bench.probes.liger_head                          # Qwen2.5-0.5B's head (896 x 151,936), float32, CPU
    python -m bench.probes.liger_head --points 4x256 1x1024 --repeats 2

One JSON line per side and point; docs/benchmarks.md "The head: grpo_lab's against liger-kernel's" keeps the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import time
from pathlib import Path

import torch

MiB = 2**20


def hwm_mib() -> float:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def rss_mib() -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # why: VmHWM then reads this side's peak alone


def sides(chunk: int, liger_chunk: int, temperature: float = 1.0):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    from grpo_lab.algo.head import chunked_logprobs
    from grpo_lab.algo.losses import BatchTotals, LossSettings, grpo_loss

    settings = LossSettings("dapo", 0.0, 0.2, 0.28)
    fused = LigerFusedLinearGRPOLoss(beta=0.0, compiled=False, use_ref_model=False, loss_type="dapo",
                                     epsilon_low=0.2, epsilon_high=0.28, temperature=temperature,
                                     chunk_size=liger_chunk)  # fmt: skip

    def lab(h, w, targets, mask, advantages):
        rows, length, hidden = h.shape
        logps = chunked_logprobs(h.reshape(-1, hidden), w, None, targets.reshape(-1), temperature, chunk)
        totals = BatchTotals(rows, int(mask.sum()), length)
        return grpo_loss(logps.reshape(rows, length), None, None, advantages, mask, totals, settings)[0]

    def liger(h, w, targets, mask, advantages):
        return fused(h, w, targets, mask, advantages)[0]

    return {"grpo_lab chunked": lab, "liger fused": liger}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--points", nargs="+", default=["4x256", "1x1024"], help="ROWSxLENGTH")
    parser.add_argument("--chunk", type=int, default=128, help="grpo.logprob_chunk_size")
    parser.add_argument("--liger-chunk", type=int, default=1, help="LigerFusedLinearGRPOLoss chunk_size (sequences)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5
    for point in args.points:
        rows, length = map(int, point.split("x"))
        hidden = torch.randn(rows, length, args.hidden, generator=g)
        targets = torch.randint(0, args.vocab, (rows, length), generator=g)
        mask = torch.ones(rows, length)
        advantages = torch.randn(rows, generator=g)
        results = {}
        for repeat in range(args.repeats):
            for name, fn in sides(args.chunk, args.liger_chunk).items():
                h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                gc.collect()
                start_rss = rss_mib()
                reset_hwm()
                start = time.perf_counter()
                loss = fn(h, w, targets, mask, advantages)
                loss.backward()
                seconds = time.perf_counter() - start
                peak = hwm_mib() - start_rss
                results[name] = (loss.detach(), h.grad, w.grad)
                print(json.dumps({"point": point, "side": name, "repeat": repeat, "seconds": round(seconds, 2),
                                  "peak_above_start_mib": round(peak), "loss": float(loss)}))  # fmt: skip
                del h, w, loss
        ours, theirs = results["grpo_lab chunked"], results["liger fused"]
        diff = [float((a - b).abs().max()) for a, b in zip(ours, theirs)]
        print(
            json.dumps(
                {"point": point, "max_abs_diff": {"loss": diff[0], "hidden_grad": diff[1], "head_grad": diff[2]}}
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
