#!/usr/bin/env bash
# The frontier's GPU check as one device call (issue 38): the gpu-marked offload and builder tests, then
# bench/gpu/frontier.py's three sides at once, every part under its own timeout, results in $OUT as they come.
#   bash bench/gpu/frontier.sh qwen3 24      # Qwen3-8B's shape, G=2, a 24 GiB card emulated, 4K..64K tokens
#   bash bench/gpu/frontier.sh qwen25 24     # Qwen2.5-7B's shape, G=8, 24 GiB, 4K and 8K tokens
# Needs .site/ beside the repo on a bare GPU machine here (../shared/gpu/site.sh).
set -u
export PYTHONPATH=$PWD/.site:$PWD/.site/plotly.whl:$PWD GRPO_LAB_CACHE=/tmp/grpo-lab-cache HF_HUB_OFFLINE=1
OUT=${OUT:-frontier-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.txt" 2>&1
case "${1:-qwen3}" in
  tests)
    timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_activation_offload.py \
      tests/test_random_shapes.py > "$OUT/gpu_tests.txt" 2>&1; tail -5 "$OUT/gpu_tests.txt" ;;
  qwen3)
    timeout 420 python -m bench.gpu.frontier --out "$OUT" --model builtin:qwen3-8b-random --cap-gib "${2:-24}" \
      --generations 2 --lengths 4096 8192 16384 32768 65536 --timeout 400 ;;
  edge)  # the edge again with the caching allocator's expandable segments (no fragmentation), every side
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 python -m bench.gpu.frontier --out "$OUT" \
      --model builtin:qwen3-8b-random --cap-gib "${2:-24}" --generations 2 --lengths 32768 65536 --timeout 280 ;;
  default)  # offload's edge with grpo_lab's own allocator default (memory.cuda_expandable_segments), no env
    timeout 260 python -m bench.gpu.frontier --out "$OUT" --model builtin:qwen3-8b-random --cap-gib "${2:-24}" \
      --generations 2 --lengths 65536 131072 --sides grpo_lab+offload --timeout 240 ;;
  qwen25)
    timeout 300 python -m bench.gpu.frontier --out "$OUT" --model builtin:qwen2.5-7b-random --cap-gib "${2:-24}" \
      --generations 8 --lengths 4096 8192 --timeout 280 ;;
esac
python -m bench.gpu.frontier --table "$OUT/frontier.jsonl" 2>/dev/null || true
