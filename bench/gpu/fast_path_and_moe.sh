#!/usr/bin/env bash
# The prepared device check for the fast rollout on one 24 GiB card and the 30B-A3B mixture of experts, one call of at
# most 9 minutes: each part under its own timeout, every record appended to $OUT/gpu_check.jsonl as it comes (a part
# that times out loses only itself). Dry-run on the CPU first: bench/gpu/fast_path_and_moe.sh --dry-run
#   On the GPU machine (bare): ../shared/gpu/site.sh here first, carry .site, and run
#     export PYTHONPATH=$PWD/.site:$PWD/.site/plotly.whl:$PWD GRPO_LAB_CACHE=$PWD/.site/cache HF_HUB_OFFLINE=1
#     bash bench/gpu/fast_path_and_moe.sh
# Parts:
#   1. Qwen3-30B-A3B's shape (random weights, drawn and quantized a layer at a time) on a card held to 24 GiB: a real
#      GRPO step (an hf rollout, 1 prompt x 8, 1,024 tokens), each phase's peak beside the plan; TRL 1.16 on the same
#      cap (its failure recorded as it comes).
#   2. Qwen3-8B's shape on 24 GiB, 1,024 tokens: the merged rollout copy with the learner parked, against dynamic and
#      TRL, rollouts' tokens/s and each phase's peak against plan.
#   3. Qwen2.5-0.5B's shape, 256 tokens: rollouts 1-3 of dynamic, merged and auto (warm-up 2 steps, then 1 timed).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/fast_path_and_moe}
PY=${PYTHON:-python}
if [ "${1:-}" = "--dry-run" ]; then  # the plumbing on the CPU: 1 layer, 8 tokens, no TRL, nothing timed
  $PY -m bench.gpu.gpu_check --device cpu --model "builtin:qwen3-30b-a3b-random:layers=1" --lengths 8 \
    --steps 1 --warmup 0 --skip-smoke --sides grpo_lab --out "${OUT}_dry/moe" || exit 1
  exec $PY -m bench.gpu.gpu_check --device cpu --model "builtin:qwen3-8b-random:layers=1" --lengths 8 \
    --steps 1 --warmup 0 --skip-smoke --sides grpo_lab --out "${OUT}_dry/park8b" \
    --variant "merged_park:generator.hf_decode=merged,generator.park_learner=true"
fi
mkdir -p "$OUT"
timeout 240 $PY -m bench.gpu.gpu_check --model builtin:qwen3-30b-a3b-random --lengths 1024 --cap-gib 24 \
  --steps 1 --warmup 0 --skip-smoke --timeout-long 220 --no-variants \
  --out "$OUT/moe" | tee -a "$OUT/log.txt"
timeout 200 $PY -m bench.gpu.gpu_check --model builtin:qwen3-8b-random --lengths 1024 --cap-gib 24 \
  --steps 1 --warmup 0 --skip-smoke --timeout-long 180 \
  --variant "merged_park:generator.hf_decode=merged,generator.park_learner=true" \
  --out "$OUT/park8b" | tee -a "$OUT/log.txt"
timeout 100 $PY -m bench.gpu.gpu_check --lengths 256 --steps 1 --warmup 2 --skip-smoke --timeout 90 \
  --variant "merged:generator.hf_decode=merged" --variant "auto:generator.hf_decode=auto" \
  --out "$OUT/small" | tee -a "$OUT/log.txt"
