#!/usr/bin/env bash
# One device call: GPU parity tests, an end-to-end smoke run on dummy weights, kernel checks.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/ops tests/executor > "$OUT/pytest_gpu.log" 2>&1
echo "pytest rc=$?"; tail -25 "$OUT/pytest_gpu.log"
timeout 130 python3 -m moeserve bench latency --model shared/model-shapes/deepseek-v2-lite.json --load-format dummy \
  --batch-size 8 --input-len 1024 --output-len 64 --max-model-len 4096 --cuda-graph-max-bs 64 --analyze-floor \
  --output-file "$OUT/smoke.json" > "$OUT/smoke.log" 2>&1
echo "smoke rc=$?"; grep -v "^INFO:moeserve.ops" "$OUT/smoke.log" | tail -12
timeout 100 python3 benchmarks/kernels/check_attention.py > "$OUT/attention.log" 2>&1; echo "attention rc=$?"; tail -30 "$OUT/attention.log"
timeout 100 python3 benchmarks/kernels/check_moe.py --no-v3 > "$OUT/moe.log" 2>&1; echo "moe rc=$?"; tail -30 "$OUT/moe.log"
timeout 45 python3 benchmarks/kernels/check_small_ops.py > "$OUT/small_ops.log" 2>&1; echo "small rc=$?"; tail -15 "$OUT/small_ops.log"
