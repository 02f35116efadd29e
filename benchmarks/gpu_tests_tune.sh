#!/usr/bin/env bash
# One device call: every GPU test, the FP8 KV accuracy check, and a full MoE tune for V2-Lite.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/tuned"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -rf --durations=5 tests > "$OUT/pytest_gpu.log" 2>&1
echo "pytest rc=$?"; tail -22 "$OUT/pytest_gpu.log"
timeout 90 python3 benchmarks/fp8_kv_accuracy.py --device cuda --prompts 32 --new-tokens 64 --output-file "$OUT/fp8_kv_accuracy.json" > "$OUT/fp8.log" 2>&1
echo "fp8 rc=$?"; grep -A4 '"fp8_vs_bf16\|"fp32_vs\|kv_tokens\|logprob_abs' "$OUT/fp8.log" | head -20
timeout ${TUNE_TIMEOUT:-150} python3 -m moeserve.ops.triton.tune_moe --experts 64 --hidden 2048 --inter 1408 --topk 6 \
  --batch-sizes 1 2 4 8 16 32 64 128 256 512 1024 2048 4096 8192 16384 --output "$OUT/tuned" > "$OUT/tune.log" 2>&1
echo "tune rc=$?"; cat "$OUT/tune.log" | tail -17
for f in "$OUT"/tuned/*.json; do cp "$f" "$OUT/moe_tuned_v2lite_h200.json"; done
