#!/usr/bin/env bash
# One device call: kernel-time profiles of prefill and decode on the shared random checkpoint, then
# (unless SKIP_TESTS=1) every GPU test.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
CKPT=/tmp/v2lite
python3 shared/tools/make_random_checkpoint.py shared/model-shapes/deepseek-v2-lite.json $CKPT | tail -1
timeout ${PROFILE_TIMEOUT:-150} python3 benchmarks/profile_step.py --model $CKPT --batch-sizes ${PROFILE_BS:-1,8,64,256} > "$OUT/profile.log" 2>&1
echo "profile rc=$?"; grep -v "^INFO" "$OUT/profile.log" | grep -E "^(==|  )" | head -${PROFILE_LINES:-260}
rm -rf $CKPT
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -v -m gpu -n 4 -p no:cacheprovider -p no:benchmark tests > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest rc=$?"; pkill -9 -f "pytest" 2>/dev/null
  grep -cE " PASSED" "$OUT/pytest_gpu.log"; grep -E " (FAILED|ERROR)" "$OUT/pytest_gpu.log" | head -20; tail -3 "$OUT/pytest_gpu.log"
fi
