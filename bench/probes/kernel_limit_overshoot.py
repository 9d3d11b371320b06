"""How far past the guard's line a crossing step gets under a kernel-enforced host limit (placement.host_limit:
cgroup), and whether the kernel kills it first: each case is a child process (tests/kernel_limit_child.py) whose Lab
sits in a fresh memory cgroup, its crossing step run with the live guard (`live`), without the room check before one
big native allocation (`unchecked`), or with neither (`off`); then the fix under the same limit.

    python -m bench.probes.kernel_limit_overshoot [--out DIR] [--rounds 3] [--cases hog,03,04]

Prints one line per run (rc, where it stopped, peak past the line as a share of the limit) and writes DIR/runs.jsonl.
Needs root and a memory cgroup controller (memory/kernel_limit.py says why not, in one line).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = ROOT / "tests" / "kernel_limit_child.py"
MODES = {"hog": ("live", "off"), "03": ("live", "off"), "04": ("live", "unchecked")}


def reprint(path: Path) -> None:
    """The lines of a runs.jsonl again (`--show`)."""
    for line in path.read_text().splitlines():
        print(line_of(json.loads(line)))


def run(kind: str, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(CHILD), kind, mode], capture_output=True, text=True, env=env, cwd=ROOT)
    events = {e["event"]: e for e in map(json.loads, filter(lambda x: x.startswith("{"), done.stdout.splitlines()))}
    out = {"case": kind, "mode": mode, "rc": done.returncode, "seconds": time.perf_counter() - start, **events}
    loaded, stopped = events.get("loaded", {}), events.get("stopped")
    if stopped and loaded:
        out["past_line_share"] = (stopped["peak_mib"] - stopped["line_mib"]) / loaded["limit_mib"]
    return out


def line_of(r: dict) -> str:
    limit = r.get("loaded", {}).get("limit_mib", 0)
    if r["rc"] != 0:
        return f"{r['case']} {r['mode']}: rc {r['rc']} (killed), limit {limit:,.0f} MiB, {r['seconds']:.0f} s"
    s, fixed = r.get("stopped"), r.get("fixed", {})
    if s and "would reach" in s["message"]:  # refused before one native call (algo/room.py): its peak stays under
        before = s["message"].split("before ")[1].split(", no update")[0]
        where = (
            f"refused before {before}, its peak {s['peak_mib']:,.0f} MiB under the {s['line_mib']:,.0f} MiB line, "
            f"undone bit for bit: {s['same']}"
        )
    elif s:
        where = (
            f"stopped in {s['phase']} at {s['peak_mib']:,.0f} MiB against the {s['line_mib']:,.0f} MiB line "
            f"({r['past_line_share']:+.2%} of the limit), undone bit for bit: {s['same']}"
        )
    else:
        where = f"ran at {r['ran']['peak_mib']:,.0f} MiB"
    return (
        f"{r['case']} {r['mode']}: rc 0, limit {limit:,.0f} MiB, {where}; the fix {fixed.get('peak_mib', 0):,.0f} "
        f"MiB; {r['seconds']:.0f} s"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each case's live mode")
    parser.add_argument("--cases", default="hog,03,04")
    parser.add_argument("--show", default=None, help="print the lines of this runs.jsonl and stop")
    args = parser.parse_args(argv)
    if args.show:
        return reprint(Path(args.show))
    out = Path(args.out or tempfile.mkdtemp(prefix="grpo-lab-kernel-limit-"))
    out.mkdir(parents=True, exist_ok=True)
    with (out / "runs.jsonl").open("a") as raw:
        for kind in args.cases.split(","):
            live, other = MODES[kind]
            for mode in [live] * args.rounds + [other]:
                r = run(kind, mode)
                raw.write(json.dumps(r) + "\n")
                raw.flush()
                print(line_of(r), flush=True)
    print(f"wrote {out / 'runs.jsonl'}")


if __name__ == "__main__":
    main()
