#!/bin/bash
# One device call: ncu counters of the ws main kernel for a few masks and consumer counts,
# for the question "is a private walk (one consumer) bound by L2 -> SM traffic?": L2 and
# DRAM throughput and L2 hit rate per kernel (the gmma pipe metric read n/a on the H200's ncu,
# 2026-11-29; kept for an ncu that has it). A trailing consumer count forces it (ws_ncu_one.py).
# Usage (device, repo root): bash bench/ws_l2_ncu.sh ; $OUT/ncu-l2-N.txt per case, a summary on stdout
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 STOFC_CACHE_DIR=${STOFC_CACHE_DIR:-/tmp/stofc-cache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
METRICS=sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum.per_second,lts__t_bytes.sum,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_read.sum.per_second,gpu__time_duration.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__m_xbar2l1tex_read_bytes.sum.per_second,sm__cycles_elapsed.avg.per_second
NCU="ncu --clock-control none -k regex:_k[01]$ --launch-skip 2 --launch-count 1 --metrics $METRICS"
i=0
while read -r args; do
  [ -z "$args" ] && continue
  i=$((i+1))
  echo "== $args"
  timeout 150 $NCU python3 bench/ws_ncu_one.py $args > "$OUT/ncu-l2-$i.txt" 2>&1
  grep -E "stofc_attn|warp-specialised|gmma|lts__|dram__|gpu__time|xbar2l1tex|cycles_elapsed" "$OUT/ncu-l2-$i.txt" | head -14
done <<< "${L2_CASES:-bigbird:block=64,window=3,global=2,random=3,seed=0 8192 1 12 64 float16
bigbird:block=64,window=3,global=2,random=3,seed=0 8192 1 12 64 float16 4
longformer:window=256,global=16 8192 1 12 64 float16
longformer:window=256,global=16 8192 1 12 64 float16 4
dense 8192 1 12 64 float16
bigbird:block=64,window=3,global=2,random=3,seed=0 16384 1 16 128 bfloat16}"
