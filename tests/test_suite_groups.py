"""scripts/test.sh's passes rest on pytest-xdist's `--dist loadgroup`: a module whose tests share a module-scoped
fixture (one vLLM engine, one loaded Lab) keeps them on one worker through its `xdist_group` mark, and the solo pass
runs the ranks' group beside the browser's, a worker each. A pytest the locked pytest-xdist cannot group (pytest 9.2
stopped honouring the node-id suffix xdist groups by: pytest-dev/pytest-xdist#1386) spreads a group's tests over
both workers without a word: each builds the module's fixture again, and two Ray clusters run at once. This runs the
installed pytest and pytest-xdist, with test.sh's options, on a sample whose groups a round-robin would split."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

SAMPLE = """
import os, time, pytest

def record(name):
    time.sleep(0.2)  # why: instant tests let one worker take every free test before the other's first one ended
    with open(os.environ["GROUPS_LOG"], "a") as log:
        log.write(f"{name} {os.environ['PYTEST_XDIST_WORKER']}\\n")

@pytest.mark.xdist_group("{group}")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    record("{group}")

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    record("free")
"""


def test_each_xdist_group_runs_on_one_worker(tmp_path):
    for group in ("ranks", "browser"):
        (tmp_path / f"test_{group}.py").write_text(SAMPLE.replace("{group}", group))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # why: the sample's own rootdir, not this repo's options
    log = tmp_path / "groups.log"
    command = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "-q"]
    env = {**os.environ, "GROUPS_LOG": str(log)}
    proc = subprocess.run([*command, str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    workers = defaultdict(set)
    for line in log.read_text().splitlines():
        name, worker = line.split()
        workers[name].add(worker)
    assert len(workers["free"]) == 2, f"the ungrouped tests should use both workers: {dict(workers)}"
    split = {g: sorted(w) for g, w in workers.items() if g != "free" and len(w) != 1}
    assert not split, (
        f"xdist groups split over workers: {split}; the installed pytest cannot be grouped by pytest-xdist "
        "(pytest-dev/pytest-xdist#1386): keep pytest below 9.2 (pyproject.toml's dev extra)"
    )


# --- how many workers: scripts/workers.sh ---------------------------------------------------------------------

WORKERS = Path(__file__).resolve().parent.parent / "scripts" / "workers.sh"


def workers(*prefix: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "GRPO_LAB_TEST_WORKERS"}
    return subprocess.run([*prefix, "bash", str(WORKERS)], capture_output=True, text=True, env={**environ, **env})


def by_ram() -> int:
    available = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemAvailable"))
    return int(available.split()[1]) // (4 * 1024 * 1024)


def test_the_workers_follow_the_cores_whatever_openmp_is_told():
    """test.sh exports OMP_NUM_THREADS=1 before it counts, and nproc prints OMP_NUM_THREADS when set: every run
    got one worker (a --quick of 9 min instead of 3-4, seen)."""
    cores = len(os.sched_getaffinity(0))
    out = workers(OMP_NUM_THREADS="1", OMP_THREAD_LIMIT="1")
    assert out.returncode == 0 and out.stdout.strip() == str(max(1, min(cores, by_ram()))), out
    if shutil.which("taskset") and cores > 1:
        one = workers("taskset", "-c", str(min(os.sched_getaffinity(0))), OMP_NUM_THREADS="1")
        assert one.stdout.strip() == "1", one


@pytest.mark.parametrize("value", ["abc", "0", "-1", "2.5"])
def test_a_worker_count_that_is_no_whole_number_is_one_line_and_exit_2(value):
    out = workers(GRPO_LAB_TEST_WORKERS=value)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.count("\n") == 1 and f"GRPO_LAB_TEST_WORKERS={value}: give a whole number" in out.stderr


def test_a_worker_count_given_is_the_count():
    assert workers(GRPO_LAB_TEST_WORKERS="3").stdout.strip() == "3"
