"""The log-prob head's chunk size: time and largest buffer of forward + backward against
`grpo.logprob_chunk_size`, at Qwen2.5's vocabulary, chunk sizes interleaved round by round.

    .venv/bin/python bench/probes/head_chunk.py --tokens 2048 --hidden 128 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from grpo_lab.algo.head import chunked_logprobs, trl_logprobs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chunks", default="16,32,64,128,256,512,1024")
    args = p.parse_args()
    torch.manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden) * 0.02).bfloat16()  # a frozen bf16 LM head, as under LoRA
    hidden = torch.randn(args.tokens, args.hidden, requires_grad=True)
    targets = torch.randint(0, args.vocab, (args.tokens,))
    heads = {f"chunked {c}": (chunked_logprobs, int(c)) for c in args.chunks.split(",")}
    heads["trl fused"] = (trl_logprobs, 0)
    times: dict[str, list[float]] = {name: [] for name in heads}
    for _ in range(args.rounds):
        for name, (fn, chunk) in heads.items():
            start = time.perf_counter()
            fn(hidden, weight, None, targets, 1.0, chunk).sum().backward()
            times[name].append(time.perf_counter() - start)
            hidden.grad = None
    print(f"| head | chunk buffer MiB | median s (fwd+bwd, {args.tokens} tokens) | min s |")
    print("|---|---|---|---|")
    for name, (_fn, chunk) in heads.items():
        buffer = chunk * args.vocab * 4 / 2**20 if chunk else float("nan")
        print(f"| {name} | {buffer:.0f} | {statistics.median(times[name]):.2f} | {min(times[name]):.2f} |")


if __name__ == "__main__":
    main()
