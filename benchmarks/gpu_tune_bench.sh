#!/usr/bin/env bash
# One device call: tune the fused MoE for DeepSeek-V2-Lite on this GPU, then run the issue-4
# workloads on the shared random checkpoint with the tuned configs, then the graph-set comparison.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/moe_configs"
CKPT=/tmp/v2lite
# Sequential, so that the tuner's timings do not share the GPU with the checkpoint writer.
[ -f $CKPT/model.safetensors.index.json ] || python3 shared/tools/make_random_checkpoint.py shared/model-shapes/deepseek-v2-lite.json $CKPT
timeout ${TUNE_TIMEOUT:-150} python3 -m moeserve.ops.triton.tune_moe --experts 64 --hidden 2048 --inter 1408 --topk 6 \
  --batch-sizes 1 4 16 64 256 1024 8192 --quick --output "$OUT/moe_configs" > "$OUT/tune.log" 2>&1
echo "tune rc=$?"; tail -12 "$OUT/tune.log"; ls "$OUT/moe_configs"
export MOESERVE_MOE_CONFIG_DIR=$OUT/moe_configs
timeout ${SUITE_TIMEOUT:-190} python3 benchmarks/gpu_suite.py --model $CKPT --output "$OUT/suite.json" --parts latency,offline > "$OUT/suite.log" 2>&1
echo "suite rc=$?"; grep -E "^(b[0-9]|ttft|offline|device)" "$OUT/suite.log"
timeout ${GRAPHS_TIMEOUT:-160} python3 benchmarks/gpu_suite.py --model $CKPT --output "$OUT/graph_sets.json" --parts graph_sets > "$OUT/graph_sets.log" 2>&1
echo "graph sets rc=$?"; grep -E "^graph set|captured" "$OUT/graph_sets.log"
