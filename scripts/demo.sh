#!/usr/bin/env bash
# The main job: install (if needed), then run GRPO steps on the built-in tiny model (preset tiny-demo; the model
# is built on first use in the user cache, GRPO_LAB_CACHE or ~/.cache/grpo_lab).
# Extra arguments go to `grpo-lab run`, e.g. scripts/demo.sh --steps 3
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/grpo-lab run tiny-demo "$@"
