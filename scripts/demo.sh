#!/usr/bin/env bash
# The main job: install (if needed), build the tiny local model (if absent), run GRPO steps on it.
# Extra arguments go to `grpo-lab run`, e.g. scripts/demo.sh --steps 3
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
.venv/bin/grpo-lab tiny .cache/tiny-qwen2
exec .venv/bin/grpo-lab run configs/tiny-cpu.yaml "$@"
