#!/bin/bash
# One device call: every GPU test (tests/gpu), with a log per file under $OUT.
# Usage (device machine, repo root): bash bench/gpu_all.sh ; env TEST_TIMEOUT (s, default 520)
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 STOFC_CACHE_DIR=/tmp/stofc-cache STOFC_DUMP_DIR=$OUT/dump
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv \
  | tee "$OUT/gpu.txt"
python3 -c "import stofc.compile as c; print(c.include_dirs(), c.nvrtc_version())" 2>&1 \
  | tee -a "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-520}" python3 -m pytest -q -p no:cacheprovider -rfEs \
  --junitxml="$OUT/gpu-tests.xml" tests/gpu 2>&1 | tee "$OUT/gpu-tests.log" | grep -v "^$" | tail -40
