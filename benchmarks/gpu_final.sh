#!/usr/bin/env bash
# One device call: the issue-4 workloads with the committed tuned configs on a quiet GPU, the
# x2 / +64 / +8 CUDA-graph set comparison, then every GPU test (compiling dominates: 4 workers).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
CKPT=/tmp/v2lite
python3 shared/tools/make_random_checkpoint.py shared/model-shapes/deepseek-v2-lite.json $CKPT | tail -1
timeout ${SUITE_TIMEOUT:-140} python3 benchmarks/gpu_suite.py --model $CKPT --output "$OUT/suite.json" --parts latency,offline > "$OUT/suite.log" 2>&1
echo "suite rc=$?"; grep -E "^(b[0-9]|ttft|offline|device)" "$OUT/suite.log"
timeout ${GRAPHS_TIMEOUT:-170} python3 benchmarks/gpu_suite.py --model $CKPT --output "$OUT/graph_sets.json" --parts graph_sets > "$OUT/graph_sets.log" 2>&1
echo "graph sets rc=$?"; grep -E "^graph set|captured|Error" "$OUT/graph_sets.log" | cut -c1-160
rm -rf $CKPT
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -v -m gpu -n 4 -p no:cacheprovider -p no:benchmark tests > "$OUT/pytest_gpu.log" 2>&1
echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
grep -cE " PASSED" "$OUT/pytest_gpu.log"; grep -E " (FAILED|ERROR)" "$OUT/pytest_gpu.log" | head; tail -3 "$OUT/pytest_gpu.log"
