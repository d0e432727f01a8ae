#!/bin/bash
# One device call: ncu on representative attention kernels (counters, no clock control).
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 STOFC_CACHE_DIR=/tmp/stofc-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCU="ncu --clock-control none -k regex:stofc_attn --launch-skip 3 --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section InstructionStats"
i=0
while read -r args; do
  [ -z "$args" ] && continue
  i=$((i+1))
  python3 bench/profile_attention.py $args 2>&1 | tail -1
  timeout 120 $NCU python3 bench/profile_attention.py $args > "$OUT/ncu$i.txt" 2>&1
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Executed Ipc A|Achieved Occupancy|Registers Per|Theoretical Occ|Stall|Pipe|Shared Memory|L1/TEX Hit|L2 Hit|One or More|No Eligible" "$OUT/ncu$i.txt" | head -40
done <<< "${PROFILE_CASES:-causal 4096 128 block 32 4 2 1 0
sliding:window=128 1024 64 block 16 4 2 1 0}"
