#!/usr/bin/env bash
# One device call: every GPU test (in parallel: compiling dominates), then the issue-4 workloads with
# the committed tuned configs, then the x2 / +64 / +8 CUDA-graph set comparison.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
CKPT=/tmp/v2lite
python3 shared/tools/make_random_checkpoint.py shared/model-shapes/deepseek-v2-lite.json $CKPT > "$OUT/ckpt.log" 2>&1 &
CKPT_PID=$!
timeout ${TEST_TIMEOUT:-230} python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rf tests > "$OUT/pytest_gpu.log" 2>&1
echo "pytest rc=$?"; tail -12 "$OUT/pytest_gpu.log"
wait $CKPT_PID; tail -1 "$OUT/ckpt.log"
timeout ${SUITE_TIMEOUT:-150} python3 benchmarks/gpu_suite.py --model $CKPT --output "$OUT/suite.json" --parts latency,offline > "$OUT/suite.log" 2>&1
echo "suite rc=$?"; grep -E "^(b[0-9]|ttft|offline|device)" "$OUT/suite.log"
timeout ${GRAPHS_TIMEOUT:-170} python3 benchmarks/gpu_suite.py --model $CKPT --output "$OUT/graph_sets.json" --parts graph_sets > "$OUT/graph_sets.log" 2>&1
echo "graph sets rc=$?"; grep -E "^graph set|captured|Error" "$OUT/graph_sets.log" | cut -c1-200
