"""The README's test command on a fresh clone, timed pass by pass: clones this checkout's HEAD (or
`--ref`) into a temporary directory, runs `.ci/run` there (install, ruff, then scripts/test.sh's three passes), prints
one JSON line and deletes the clone. The passes are timed by the moment each pytest session starts and ends on the
console; the machine's speed is read beside them (the demo's five seeds run the same work on every run: their median
call time), since the same code measured 23 and 32 minutes on this 2-core machine on one day.

    python -m bench.suite.suite_time                          # HEAD on every usable core, without uv's cache
    python -m bench.suite.suite_time --cores 1                # pinned to one core (taskset): the 1-core check
    python -m bench.suite.suite_time --out bench/results/suite_time_cpu_2026-12-02/runs.jsonl
    python -m bench.suite.suite_time --quick                  # the edit-test loop: scripts/test.sh --quick, twice
                                                              # (the first builds the models it keeps; the second is
                                                              # the figure)
    python -m bench.suite.suite_time --parse LOG --total-s 3600   # a console already written (this script's, with
                                                                  # line times, or a plain one)

Nothing else should run on the machine meanwhile: the figure is its wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from grpo_lab.checks.world import usable_cpus

ROOT = Path(__file__).resolve().parents[2]
PASSES = ("xdist", "solo", "alone")  # scripts/test.sh's order
STARTS = re.compile(r"^=+ test session starts =+$")
ENDS = re.compile(r"^=+ (?P<summary>.*\d+ (?:passed|failed|error|errors|skipped|deselected).*) in (?P<s>[\d.]+)s\b")
DURATION = re.compile(r"^(?P<s>[\d.]+)s (?P<when>call|setup|teardown)\s+(?P<test>\S+)$")
YARDSTICK = "tests/test_demo_learns.py::test_the_demo_learns_to_answer_on_seeds_0_to_4["


def read_console(lines: list[tuple[float | None, str]]) -> dict:
    """The passes in a console of (seconds since the start or None, line): each pass's summary, pytest's own seconds
    and, where lines carry times, its wall time from session start to summary; the demo seeds' median call time."""
    passes, started = [], None
    for at, line in lines:
        if STARTS.match(line):
            started = at
        elif match := ENDS.match(line):
            wall = None if at is None or started is None else round(at - started, 1)
            passes.append(
                {
                    "pytest_s": float(match["s"]),
                    "wall_s": wall,
                    "summary": match["summary"],
                    "at": None if at is None else round(at, 1),
                }
            )
    if len(passes) > len(PASSES):
        raise ValueError(f"{len(passes)} pytest summaries in one console: expected at most {len(PASSES)}")
    seeds = [
        float(m["s"])
        for _, line in lines
        if (m := DURATION.match(line)) and m["when"] == "call" and m["test"].startswith(YARDSTICK)
    ]
    failed = [p["summary"] for p in passes if re.search(r"\d+ (failed|errors?)\b", p["summary"])]
    return {
        "passes": {name: p for name, p in zip(PASSES, passes)},
        "demo_seed_call_s": round(statistics.median(seeds), 1) if seeds else None,
        "every_test_passed": bool(passes) and not failed,
    }


TIMED = re.compile(r"^ *(?P<at>\d+\.\d) (?P<line>.*)$")  # a line of the console this script writes: seconds, then it


def console_lines(text: str) -> list[tuple[float | None, str]]:
    """A console file's lines with their times: the timed console this script writes, or a plain one (no times)."""
    raw = text.splitlines()
    timed = [TIMED.match(line) for line in raw]
    if raw and all(timed):
        return [(float(m["at"]), m["line"]) for m in timed]
    return [(None, line) for line in raw]


def machine(cores: int | None) -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    mem = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    return {
        "cpu": model[1] if model else None,
        "avx512_bf16": "avx512_bf16" in cpuinfo,
        "cores": cores or usable_cpus(),
        "machine_cores": os.cpu_count(),
        "mem_gib": round(int(mem[1]) / 2**20, 1) if mem else None,
        "workers_set": os.environ.get("GRPO_LAB_TEST_WORKERS"),  # None: scripts/workers.sh counted them
    }


CI = "bash .ci/run"
# why twice: --quick keeps the built models between runs (.artifacts/test-cache), and its figure is the loop's, not
# the first run's; its console is dropped, and `|| :` leaves a failure in it to the second run, which fails too
QUICK = "scripts/install.sh && (scripts/test.sh --quick -q >/dev/null || :) && scripts/test.sh --quick"


def run_fresh_clone(
    ref: str, cores: int | None, log: Path, uv_cache: bool, command: str
) -> tuple[int, list[tuple[float, str]], float]:
    where = Path(tempfile.mkdtemp(prefix="grpo-lab-suite-time."))
    clone = where / "clone"
    try:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "-q", ref], check=True)
        pin = ["taskset", "-c", ",".join(map(str, sorted(os.sched_getaffinity(0))[:cores]))] if cores else []
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # why: a line's time is when it was printed, not flushed
        env.pop("VIRTUAL_ENV", None)
        if not uv_cache:
            env["UV_NO_CACHE"] = "1"  # why: a fresh machine has no wheels cached
        lines: list[tuple[float, str]] = []
        start = time.monotonic()
        with log.open("w", buffering=1) as sink:  # why line-buffered: the console can be followed as it runs
            child = subprocess.Popen(
                [*pin, "bash", "-c", command],
                cwd=clone,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for line in child.stdout:
                lines.append((time.monotonic() - start, line.rstrip("\n")))
                sink.write(f"{lines[-1][0]:9.1f} {line}")
            rc = child.wait()
        return rc, lines, time.monotonic() - start
    finally:
        shutil.rmtree(where, ignore_errors=True)  # why: a clone with its venv holds ~6 GB


def record(rc: int | None, lines, total_s: float, cores: int | None, ref: str, command: str, when: float) -> dict:
    console = read_console(lines)
    first = next((at for at, line in lines if STARTS.match(line)), None)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref], capture_output=True, text=True)
    return {
        "commit": commit.stdout.strip() or ref,
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(when)),  # when it ended
        "machine": machine(cores),
        "rc": rc,
        "total_min": round(total_s / 60, 2),
        "before_the_passes_s": None if first is None else round(first, 1),
        **console,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="HEAD", help="the commit to clone and time (default HEAD)")
    parser.add_argument("--cores", type=int, help="pin the run to this many of the usable cores (taskset)")
    parser.add_argument("--quick", action="store_true", help="time scripts/test.sh --quick (the second of two runs)")
    parser.add_argument("--uv-cache", action="store_true", help="let the install use uv's cache (not a fresh machine)")
    parser.add_argument("--log", type=Path, default=Path("suite_time.log"), help="where the timed console goes")
    parser.add_argument("--out", type=Path, help="append the JSON line to this file")
    parser.add_argument("--parse", type=Path, help="read a console already written instead of running one")
    parser.add_argument("--total-s", type=float, help="with --parse: the run's wall seconds, measured outside it")
    args = parser.parse_args(argv)
    if args.cores is not None and not 1 <= args.cores <= usable_cpus():
        parser.error(f"--cores {args.cores}: give 1 to {usable_cpus()}, the cores this process may use")
    if args.parse:
        if args.total_s is None:
            parser.error("--parse needs --total-s, the run's wall seconds (a console without line times has none)")
        lines = console_lines(args.parse.read_text())
        result = record(
            None, lines, args.total_s, args.cores, args.ref, "bash .ci/run (parsed)", args.parse.stat().st_mtime
        )
    else:
        command = QUICK if args.quick else CI
        rc, lines, total = run_fresh_clone(args.ref, args.cores, args.log, args.uv_cache, command)
        result = record(rc, lines, total, args.cores, args.ref, command, time.time())
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as sink:
            sink.write(line + "\n")
    return 0 if result["every_test_passed"] and result["rc"] in (0, None) else 1


if __name__ == "__main__":
    sys.exit(main())
