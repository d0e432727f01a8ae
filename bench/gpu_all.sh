#!/bin/bash
# One device call: GPU tests (tests/gpu unless paths are given), a log under $OUT.
# Usage (device machine, repo root): bash bench/gpu_all.sh [pytest paths and args]
#   env TEST_TIMEOUT (s, default 520), WORKERS (pytest-xdist workers, default 12)
# The whole tests/gpu no longer fits one call on a cold machine (2026-11-29: 675 of 683
# results in 540 s with 8 workers; kernel compiles dominate), so run it as two calls:
#   bash bench/gpu_all.sh tests/gpu/test_attention_ws.py
#   bash bench/gpu_all.sh tests/gpu --ignore=tests/gpu/test_attention_ws.py
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 STOFC_CACHE_DIR=${STOFC_CACHE_DIR:-/tmp/stofc-cache}
export STOFC_DUMP_DIR=$OUT/dump
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv \
  | tee "$OUT/gpu.txt"
python3 -c "import stofc.compile as c; print(c.include_dirs(), c.nvrtc_version())" 2>&1 \
  | tee -a "$OUT/gpu.txt"
[ $# -eq 0 ] && set -- tests/gpu
timeout "${TEST_TIMEOUT:-520}" python3 -m pytest -q -p no:cacheprovider -rfEs -n "${WORKERS:-12}" \
  --durations=15 --junitxml="$OUT/gpu-tests.xml" "$@" 2>&1 | grep -v -e PytestBenchmarkWarning -e "warner(" \
  | tee "$OUT/gpu-tests.log" | grep -v "^$" | tail -40
