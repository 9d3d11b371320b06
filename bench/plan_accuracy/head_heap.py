"""The log-prob head's host RSS and time with glibc's mmap threshold pinned (memory.host_mmap_threshold_mib:
0.125) against glibc's own rising threshold (null, the default): bytes of RSS per chunk element over the pass's start
(the plan counts 6: float32 logits + the bf16 matmul output) and milliseconds per forward + backward, each setting
in its own process, settings alternated round by round.

    .venv/bin/python bench/plan_accuracy/head_heap.py       # 32,000 and 151,936 vocabularies, chunks 32 and 128
    .venv/bin/python bench/plan_accuracy/head_heap.py --vocab 32000 --chunks 128 --rounds 3
    .venv/bin/python bench/plan_accuracy/head_heap.py --vocab 32000 --chunks 128 --rounds 10 --passes 5 --lab tiny-cpu
        # after a Lab
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Optional

PASS = """
import json, sys, threading, time, psutil, torch
from grpo_lab import Lab
from grpo_lab.algo.head import chunked_logprobs
from grpo_lab.memory.heap import pin_mmap_threshold, trim_host_heap
vocab, chunk, rows, hidden_size, threshold, passes, lab_config = json.loads(sys.argv[1])
lab = Lab(lab_config).load() if lab_config else None   # a Lab pins memory.host_mmap_threshold_mib at load
if lab is None:
    pin_mmap_threshold(threshold)
torch.manual_seed(0)
weight = (torch.randn(vocab, hidden_size) * 0.02).bfloat16()   # a frozen bf16 LM head, as under LoRA
proc, peak, done = psutil.Process(), [0], [False]
def sample():
    while not done[0]:
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.0005)
out = []
for _ in range(passes):
    trim_host_heap()
    start = peak[0] = proc.memory_info().rss
    done[0] = False
    t = threading.Thread(target=sample)
    t.start()
    hidden = torch.randn(rows, hidden_size, dtype=torch.bfloat16, requires_grad=True)
    began = time.perf_counter()
    chunked_logprobs(hidden, weight, None, torch.randint(0, vocab, (rows,)), 1.0, chunk).sum().backward()
    seconds = time.perf_counter() - began
    done[0] = True
    t.join()
    out.append(((peak[0] - start) / (chunk * vocab), seconds))
if lab is not None:
    lab.close()
print(json.dumps(out[1:]))   # why not the first: it maps every block before glibc's threshold has risen
"""


def head_passes(
    vocab: int,
    chunk: int,
    rows: int = 1024,
    hidden: int = 128,
    threshold: Optional[float] = None,
    passes: int = 4,
    lab_config: Optional[dict] = None,
    env: Optional[dict] = None,
) -> list[list[float]]:
    """In a fresh process (the threshold is process-wide): pin `threshold` (or load a Lab from `lab_config`, which pins
    its own), run the head forward + backward `passes` times; [RSS bytes per chunk element, seconds] of each pass
    after the first."""
    spec = json.dumps([vocab, chunk, rows, hidden, threshold, passes, lab_config])
    done = subprocess.run([sys.executable, "-c", PASS, spec], capture_output=True, text=True, env=env, timeout=600)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[32_000, 151_936])
    p.add_argument("--chunks", type=int, nargs="+", default=[32, 128])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--passes", type=int, default=4)
    p.add_argument(
        "--lab",
        metavar="PRESET",
        help="load this preset's Lab first (it pins the setting's threshold at "
        "load, as tests/test_heap.py does), then run the head",
    )
    args = p.parse_args()
    settings = {"pinned 128 KiB": 0.125, "glibc's own (default)": None}
    print(
        "| vocab | chunk | chunk MiB (float32) | setting | RSS B / chunk element: median (min-max) | ms per pass "
        "(median) |"
    )
    print("|---|---|---|---|---|---|", flush=True)
    for vocab in args.vocab:
        for chunk in args.chunks:
            got = {name: [] for name in settings}
            for _ in range(args.rounds):
                for name, threshold in settings.items():
                    got[name] += head_passes(
                        vocab,
                        chunk,
                        args.rows,
                        args.hidden,
                        threshold,
                        args.passes,
                        lab_config=lab_config(args.lab, threshold),
                    )
            for name, rows in got.items():
                per_element = [r[0] for r in rows]
                spread = f"{statistics.median(per_element):.1f} ({min(per_element):.1f}-{max(per_element):.1f})"
                ms = 1000 * statistics.median(r[1] for r in rows)
                print(
                    f"| {vocab:,} | {chunk} | {chunk * vocab * 4 / 2**20:.0f} | {name} | {spread} | {ms:.0f} |",
                    flush=True,
                )


def lab_config(preset: Optional[str], threshold: Optional[float]) -> Optional[dict]:
    """`preset` with the setting's threshold, as a dict a Lab loads in the worker; None: no Lab."""
    if preset is None:
        return None
    from grpo_lab import load_config

    return load_config(
        preset, [f"memory.host_mmap_threshold_mib={'null' if threshold is None else threshold}"]
    ).to_dict()


if __name__ == "__main__":
    main()
