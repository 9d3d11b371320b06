#!/usr/bin/env bash
# How many pytest-xdist workers scripts/test.sh runs: printed.
set -euo pipefail
# Workers follow the machine: one per usable core (nproc: the cores this process may run on), and at most one per
# 4 GiB available. Why the memory bound: a worker with its children peaks at about 3.7 GiB (measured: test_vllm's
# worker 1.9 GiB beside its engine's 1.8; test_random_shapes' 8B-shaped builder 3.2), so eight on a 16 GiB machine
# would swap. GRPO_LAB_TEST_WORKERS sets the count. CPU-rank tests need 2 cores and skip on 1 (their cores mark).
ram_workers=$(awk '/^MemAvailable:/ {print int($2 / (4 * 1024 * 1024))}' /proc/meminfo 2>/dev/null || echo 1)
# why env -u: nproc prints OMP_NUM_THREADS when it is set (test.sh sets 1), not the cores
auto_workers=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
[ "${ram_workers:-0}" -lt "$auto_workers" ] && auto_workers=${ram_workers:-1}
[ "$auto_workers" -lt 1 ] && auto_workers=1
workers=${GRPO_LAB_TEST_WORKERS:-$auto_workers}
if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
  echo "scripts/test.sh: error: GRPO_LAB_TEST_WORKERS=$workers: give a whole number of workers, 1 or more" >&2
  exit 2
fi
echo "$workers"
