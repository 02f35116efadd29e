#!/usr/bin/env bash
# One device call for a build-check-time round: GPU tests, then the issue-4 latency workloads and a
# kernel profile on the shared random checkpoint. Parts are skipped with SKIP_TESTS / SKIP_SUITE /
# SKIP_PROFILE=1.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -n ${TEST_WORKERS:-8} -p no:cacheprovider -p no:benchmark \
    --tb=short ${TEST_PATHS:-tests} > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
  grep -E "(FAILED|ERROR|passed|failed)" "$OUT/pytest_gpu.log" | tail -15
fi
CKPT=/tmp/v2lite
if [ "${SKIP_SUITE:-0}" != 1 ] || [ "${SKIP_PROFILE:-0}" != 1 ]; then
  python3 shared/tools/make_random_checkpoint.py shared/model-shapes/deepseek-v2-lite.json $CKPT | tail -1
fi
if [ "${SKIP_SUITE:-0}" != 1 ]; then
  timeout ${SUITE_TIMEOUT:-120} python3 benchmarks/gpu_suite.py --model $CKPT --output "$OUT/suite.json" \
    --parts ${SUITE_PARTS:-latency} > "$OUT/suite.log" 2>&1
  echo "suite rc=$?"; grep -E "^(b[0-9]|ttft|offline|device)|Error" "$OUT/suite.log"
fi
if [ "${SKIP_PROFILE:-0}" != 1 ]; then
  timeout ${PROFILE_TIMEOUT:-90} python3 benchmarks/profile_step.py --model $CKPT --batch-sizes ${PROFILE_BS:-1,64} \
    ${PROFILE_ARGS:---disable-cuda-graph --cpu-profile} > "$OUT/profile.log" 2>&1
  echo "profile rc=$?"
fi
rm -rf $CKPT
