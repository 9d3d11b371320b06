#!/usr/bin/env bash
# The test suite: install (if needed), then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
# why one OpenMP thread per process: the sharded tests run a driver and two rank processes on 2 cores, and torch's
# spinning OpenMP threads then slow every process severalfold (measured: minutes instead of seconds per module)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest "$@"
