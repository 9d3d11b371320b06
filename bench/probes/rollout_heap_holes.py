"""Where a CPU rollout's RSS over its plan goes at glibc's own mmap threshold: glibc's mallinfo2 and the process's
RSS every 8 decoding steps (read before that step's heap trim, if it has one) through the held-out `152k-f32` config
(bench/plan_accuracy/threshold_sweep.py's: logits-heavy-cpu in float32, 1 x 8 x 256, glibc's own threshold), with
the hf log-prob recorder as it is (`held`) or as it was (`per-step`: a [rows] tensor kept per decoding step).

    OMP_NUM_THREADS=1 python -m bench.probes.rollout_heap_holes --recorder per-step
    OMP_NUM_THREADS=1 python -m bench.probes.rollout_heap_holes --recorder held

One JSON line per reading: the step (`step`, 1-3), the decoding step (`decode`), RSS and, in MiB, glibc's heap
(`arena`: its size; `in_use`; `free`: its free blocks, resident until a trim; `mmapped`: blocks mapped on their own);
then one line with each step's phase peaks. Per-step: a rollout's heap can grow by one [rows, vocab] block (4.6 MiB
at 8 x 151,936 in float32) every decoding step, the freed ones left as holes that only the trims every 32 steps give
back (docs/benchmarks.md, "The rollout's heap holes at glibc's own threshold").
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json

MiB = 1024**2
FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]


def heap() -> dict:
    """glibc's heap (all arenas) and this process's RSS, in MiB."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = Mallinfo2
    m = libc.mallinfo2()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * 4096
    mib = {"rss": rss, "arena": m.arena, "in_use": m.uordblks, "free": m.fordblks, "mmapped": m.hblkhd}
    return {k: round(v / MiB, 1) for k, v in mib.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recorder", choices=["held", "per-step"], default="held")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    import grpo_lab.generation.hf as hf
    from bench.plan_accuracy.planner_accuracy import worker
    from bench.plan_accuracy.threshold_sweep import CONFIGS, per_step_columns
    from grpo_lab import Lab

    if args.recorder == "per-step":
        per_step_columns()
    where, trim, step = {"step": 0}, hf.TrimHeapEvery.__call__, Lab.step

    def read(self, input_ids, scores):
        if self.calls % 8 == 0:
            print(json.dumps({"recorder": args.recorder, **where, "decode": self.calls, **heap()}), flush=True)
        return trim(self, input_ids, scores)

    def counted(self, *a, **k):
        where["step"] += 1
        result = step(self, *a, **k)
        peaks = {r["phase"]: round(r["peak"] / MiB, 1) for r in result.memory if r["metric"] == "rss"}
        print(json.dumps({"recorder": args.recorder, **where, "phase_peaks_mib": peaks}), flush=True)
        return result

    hf.TrimHeapEvery.__call__, Lab.step = read, counted
    preset, sets, _ = CONFIGS["152k-f32"]
    worker(preset, [*sets, "memory.host_mmap_threshold_mib=null"], args.steps)


if __name__ == "__main__":
    main()
