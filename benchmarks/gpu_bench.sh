#!/usr/bin/env bash
# One device call: the shared random DeepSeek-V2-Lite checkpoint, the latency and offline workloads
# of ../shared/targets, and a kernel profile of decode steps.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
CKPT=/tmp/v2lite
[ -f $CKPT/model.safetensors.index.json ] || python3 shared/tools/make_random_checkpoint.py shared/model-shapes/deepseek-v2-lite.json $CKPT
PARTS=${PARTS:-latency,offline}
timeout ${SUITE_TIMEOUT:-330} python3 benchmarks/gpu_suite.py --model $CKPT --output "$OUT/suite.json" --parts $PARTS ${SUITE_ARGS:-} > "$OUT/suite.log" 2>&1
echo "suite rc=$?"; grep -v "^.*INFO moeserve.ops" "$OUT/suite.log" | grep -v Warning | tail -25
if [ -n "${PROFILE:-1}" ]; then
  timeout ${PROFILE_TIMEOUT:-120} python3 benchmarks/profile_step.py --model $CKPT --batch-sizes ${PROFILE_BS:-1,64} > "$OUT/profile.log" 2>&1
  echo "profile rc=$?"; grep -A19 "^==" "$OUT/profile.log" | cut -c1-120
fi
