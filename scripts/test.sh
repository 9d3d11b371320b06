#!/usr/bin/env bash
# The test suite: install (if needed), then pytest.
#   scripts/test.sh              the whole suite, in three passes (below), each printing its 30 slowest tests
#   scripts/test.sh --quick      the edit-test loop: everything but `slow` and `solo`, on the xdist workers
#   scripts/test.sh ARGS...      one plain pytest run with ARGS (e.g. -k parity, tests/test_step.py)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
# why: a library an install wrote sits in the page cache as large folios that a process maps whole, ~100 MiB of RSS
# above the plans the suite holds measured RSS to (scripts/drop_library_cache.py)
.venv/bin/python scripts/drop_library_cache.py
# why one OpenMP thread per process: the sharded tests run a driver and two rank processes on 2 cores, and torch's
# spinning OpenMP threads then slow every process severalfold (measured: minutes instead of seconds per module)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
workers=$(scripts/workers.sh)  # one per usable core, at most one per 4 GiB available: scripts/workers.sh
if [ "${1:-}" = "--quick" ]; then
  shift
  # why a kept cache: the loop runs again and again, and the trained built-in model takes a minute to build
  export GRPO_LAB_TEST_CACHE="${GRPO_LAB_TEST_CACHE:-$PWD/.artifacts/test-cache}"
  mkdir -p "$GRPO_LAB_TEST_CACHE"
  exec .venv/bin/python -m pytest -m "not slow and not solo" -n "$workers" --dist loadgroup "$@"
fi
if [ $# -gt 0 ]; then exec .venv/bin/python -m pytest "$@"; fi

# The whole suite. Why three passes: with one thread per process a pytest process uses one core, so the tests that
# run in one process (most of them) go two at a time (pytest-xdist, a worker per core; a module whose tests share a
# module-scoped fixture stays on one worker: its xdist_group mark, which pytest 9.2 broke: tests/test_suite_groups.py).
# The tests marked `solo` start processes of their own: the ranks' group (Ray clusters, sharded ranks: one cluster at
# a time) runs beside the browser's (JupyterLab, Chromium: mostly waiting on the page), a worker each. Those also
# marked `alone` read the machine's shared state (its used RAM, Ray's kill line) and run last, one at a time, with the
# machine to themselves.
# Why one cache for both passes: each built-in model is built once per suite (tests/conftest.py's user_cache).
GRPO_LAB_TEST_CACHE=$(mktemp -d -t grpo-lab-test-cache.XXXXXX)
export GRPO_LAB_TEST_CACHE
trap 'rm -rf "$GRPO_LAB_TEST_CACHE"' EXIT
# Why the later passes collect only the modules that say pytest.mark.solo: collecting all of them costs each pytest
# process ~15 s (tests/conftest.py refuses a solo test in a module that does not say it).
mapfile -t solo_modules < <(grep -l "pytest.mark.solo" tests/test_*.py)
rc=0
.venv/bin/python -m pytest -m "not solo" -n "$workers" --dist loadgroup --durations=30 || rc=$?
.venv/bin/python -m pytest -m "solo and not alone" -n "$workers" --dist loadgroup --durations=30 "${solo_modules[@]}" \
  || rc=$((rc ? rc : $?))
.venv/bin/python -m pytest -m alone --durations=30 "${solo_modules[@]}" || rc=$((rc ? rc : $?))
exit "$rc"
