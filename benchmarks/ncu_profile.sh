#!/usr/bin/env bash
# One device call: Nsight Compute on one decode step's kernels (ncu_step.py), per case
# BATCH:KV_DTYPE:KERNELS[:FILTER], each kept as its raw CSV and ncu_summary.py's table (the report
# itself stays in /tmp there).
#   OUT=... CASES="1:auto:36 256:fp8_e4m3:1:regex:_mla_split" bash benchmarks/ncu_profile.sh
# Clocks left alone (--clock-control none): the times are what serving sees, not base clocks.
# STEP_ARGS go to ncu_step.py; SECTIONS replaces the section list (fewer sections, fewer passes).
# At b256 all sections for the first 45 kernels outran 190 s on an H100 (10 done): name its kernels.
set -uf  # -f: no globbing of the metric and filter arguments
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
MODEL=${MODEL:-shared/model-shapes/deepseek-v2-lite.json}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv,noheader
SECTIONS=${SECTIONS:-"--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
  --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"}
# WarpStateStats brings the stall ratios ncu_summary.py ranks; the byte counts are asked for by name.
METRICS="--metrics dram__bytes_read.sum,dram__bytes_write.sum"
PROBE="import torch; x = torch.randn(2048, 2048, device='cuda'); (x @ x).sum().item()"
if ! timeout 90 $NCU --clock-control none $SECTIONS $METRICS python3 -c "$PROBE" > "$OUT/probe.txt" 2>&1 \
    || ! grep -q Duration "$OUT/probe.txt"; then
  echo "ncu cannot read this machine's counters:"; tail -5 "$OUT/probe.txt"; exit 1
fi
rm "$OUT/probe.txt"  # what comes back is 8 files at most: two a case
i=0
for case in ${CASES:-1:auto:36 256:auto:4:regex:_mla_prep|_mla_split|_moe_up|_moe_down}; do
  IFS=: read -r bs kv count filter <<< "$case"
  i=$((i + 1))
  name=ncu${i}_b${bs}_${kv}  # numbered: two cases of one batch and cache keep files of their own
  timeout ${CASE_TIMEOUT:-200} $NCU --clock-control none --profile-from-start off --graph-profiling node \
    $SECTIONS $METRICS -c "$count" ${filter:+-k "$filter"} -f -o "/tmp/$name" \
    python3 benchmarks/ncu_step.py --model "$MODEL" --load-format dummy --batch-size "$bs" --kv-cache-dtype "$kv" ${STEP_ARGS:-} \
    > "/tmp/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "profiled|Error|ERROR" "/tmp/$name.log" | head -3
  [ -f "/tmp/$name.ncu-rep" ] || { tail -5 "/tmp/$name.log"; continue; }
  $NCU --import "/tmp/$name.ncu-rep" --csv --page raw --print-units base > "$OUT/$name.csv"
  python3 benchmarks/ncu_summary.py "$OUT/$name.csv" > "$OUT/$name.summary.txt"; tail -1 "$OUT/$name.summary.txt"
done
