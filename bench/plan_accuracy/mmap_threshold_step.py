"""What pinning glibc's mmap threshold (memory.host_mmap_threshold_mib) costs a CPU step: the median step time and
the peak RSS, pinned at 128 KiB and 1 MiB against glibc's own rising threshold (null, the default), each in its own
process, alternated round by round.

    .venv/bin/python bench/plan_accuracy/mmap_threshold_step.py  # logits-heavy-cpu at 32k (256, 1024 tokens), tiny-demo
    .venv/bin/python bench/plan_accuracy/mmap_threshold_step.py --rounds 3 --steps 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CONFIGS = {
    "logits-heavy-cpu, 32k vocab": ("logits-heavy-cpu", ["model.name_or_path=builtin:qwen2-32k", "grpo.beta=0.04"]),
    "logits-heavy-cpu, 32k vocab, 1024 tokens": (
        "logits-heavy-cpu",
        ["model.name_or_path=builtin:qwen2-32k", "grpo.beta=0.04", "generator.max_completion_length=1024"],
    ),
    "tiny-demo": ("tiny-demo", ["model.gradient_checkpointing=true"]),  # why: as measured, when the preset checkpointed
}
SETTINGS = {"pinned 128 KiB": "0.125", "pinned 1 MiB": "1", "glibc's own (default)": "null"}

RUN = """
import json, sys, warnings
warnings.filterwarnings("ignore")
from grpo_lab import Lab, load_config
preset, overrides, steps = json.loads(sys.argv[1])
lab = Lab(load_config(preset, overrides)).load()
seconds, peak = [], 0
for i in range(steps):
    result = lab.step()
    if i:   # why not the first: one-off set-up (lazy imports, kernel caches)
        seconds.append(result.step_seconds)
        peak = max([peak] + [r["peak"] for r in result.memory if r["device"] == "host" and r["metric"] == "rss"])
lab.close()
print(json.dumps([seconds, peak]))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--config", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    args = p.parse_args()
    print("| config | setting | median step s | peak RSS MiB (max over rounds) | step time / glibc's own |")
    print("|---|---|---|---|---|", flush=True)
    for name in args.config:
        preset, overrides = CONFIGS[name]
        got = {s: ([], 0) for s in SETTINGS}
        for _ in range(args.rounds):
            for setting, value in SETTINGS.items():
                spec = json.dumps([preset, [*overrides, f"memory.host_mmap_threshold_mib={value}"], args.steps])
                done = subprocess.run([sys.executable, "-c", RUN, spec], capture_output=True, text=True, check=True)
                seconds, peak = json.loads(done.stdout.strip().splitlines()[-1])
                got[setting] = (got[setting][0] + seconds, max(got[setting][1], peak))
        own = statistics.median(got["glibc's own (default)"][0])
        for setting, (seconds, peak) in got.items():
            median = statistics.median(seconds)
            print(f"| {name} | {setting} | {median:.2f} | {peak / 2**20:.0f} | {median / own:.2f} |", flush=True)


if __name__ == "__main__":
    main()
