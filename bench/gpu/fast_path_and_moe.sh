#!/usr/bin/env bash
# The prepared device check for the fast rollout on one 24 GiB card and the 30B-A3B mixture of experts, one call of at
# most 9 minutes: each part under its own timeout, every record appended to $OUT/gpu_check.jsonl as it comes (a part
# that times out loses only itself). Dry-run on the CPU first: bench/gpu/fast_path_and_moe.sh --dry-run
#   On the GPU machine (bare): ../shared/gpu/site.sh here first, carry .site, and run
#     export PYTHONPATH=$PWD/.site:$PWD/.site/plotly.whl:$PWD GRPO_LAB_CACHE=$PWD/.site/cache HF_HUB_OFFLINE=1
#     bash bench/gpu/fast_path_and_moe.sh
# Parts:
#   1. (issue 70) Qwen3-30B-A3B's shape (random weights, drawn and quantized a layer at a time) on a card held to
#      24 GiB: a real GRPO step (an hf rollout, 1 prompt x 8, 512 tokens) with LoRA on attention (r 8) and on the
#      experts (lora.target_experts, expert_r 1), each phase's peak beside the plan; beside it TRL 1.16 on the same
#      cap with PEFT's target_parameters on the same experts at the same rank, its experts in bfloat16 as transformers'
#      4-bit load leaves them (its failure, e.g. out of memory at load, recorded with the stage it came in).
#      expert_r 1: PEFT gives each of the 128 experts its own rank-expert_r adapter, and r / num_experts (8 / 128)
#      rounds up to rank 1 (bench/gpu/trl_side.py says more; planned 20.2 GiB allocated at 512 tokens, 21.8 at
#      1,024; expert_r 8 plans 26.4 GiB at 1,024: over the card). Why 512 tokens, no run without expert LoRA: a 30B-A3B
#      decoding step is ~62-69k aten ops (4.7-5.2x the 0.5B shape's, counted on the CPU: bench/probes/decode_ops.py),
#      ~0.2-0.28 s at the 0.5B's H100 rate (run 2), so 1,024 tokens alone would take more than the part's budget.
#   2. Qwen3-8B's shape on 24 GiB, 1,024 tokens: the merged rollout copy with the learner parked, against dynamic and
#      TRL, rollouts' tokens/s and each phase's peak against plan.
#   3. Qwen2.5-0.5B's shape, 256 tokens: rollouts 1-3 of dynamic, merged and auto (warm-up 2 steps, then 1 timed).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/fast_path_and_moe}
PY=${PYTHON:-python}
EXPERTS=$($PY -c "from bench.gpu.trl_side import EXPERTS; print(','.join(EXPERTS))") || exit 1
if [ "${1:-}" = "--dry-run" ]; then  # the plumbing on the CPU: 1 layer, 8 tokens, one side at a time, nothing timed
  $PY -m bench.gpu.gpu_check --device cpu --model "builtin:qwen3-30b-a3b-random:layers=1" --lengths 8 \
    --steps 1 --warmup 0 --skip-smoke --sides grpo_lab trl_experts --common "$EXPERTS" --serial \
    --out "${OUT}_dry/moe" || exit 1
  exec $PY -m bench.gpu.gpu_check --device cpu --model "builtin:qwen3-8b-random:layers=1" --lengths 8 \
    --steps 1 --warmup 0 --skip-smoke --sides grpo_lab --out "${OUT}_dry/park8b" \
    --variant "merged_park:generator.hf_decode=merged,generator.park_learner=true"
fi
mkdir -p "$OUT"
timeout 240 $PY -m bench.gpu.gpu_check --model builtin:qwen3-30b-a3b-random --lengths 512 --cap-gib 24 \
  --steps 1 --warmup 0 --skip-smoke --timeout-long 225 --no-variants \
  --sides grpo_lab trl_experts --common "$EXPERTS" --out "$OUT/moe" | tee -a "$OUT/log.txt"
timeout 200 $PY -m bench.gpu.gpu_check --model builtin:qwen3-8b-random --lengths 1024 --cap-gib 24 \
  --steps 1 --warmup 0 --skip-smoke --timeout-long 180 \
  --variant "merged_park:generator.hf_decode=merged,generator.park_learner=true" \
  --out "$OUT/park8b" | tee -a "$OUT/log.txt"
timeout 100 $PY -m bench.gpu.gpu_check --lengths 256 --steps 1 --warmup 2 --skip-smoke --timeout 90 \
  --variant "merged:generator.hf_decode=merged" --variant "auto:generator.hf_decode=auto" \
  --out "$OUT/small" | tee -a "$OUT/log.txt"
