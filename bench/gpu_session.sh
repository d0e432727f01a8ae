#!/bin/bash
# One device call: GPU tests of the attention kernels, then the MHA benchmark.
# Usage (on the device machine, repo root): bash bench/gpu_session.sh [pytest-args] ; env BENCH_ARGS, TEST_TIMEOUT, BENCH_TIMEOUT
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 STOFC_CACHE_DIR=/tmp/stofc-cache STOFC_DUMP_DIR=$OUT/dump
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import stofc.compile as c; print(c.include_dirs(), c.nvrtc_version())" 2>&1 | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rf "$@" tests/gpu/test_attention.py 2>&1 | tee "$OUT/tests.log" | grep -v "^$" | tail -60
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout "${BENCH_TIMEOUT:-240}" python3 bench/mha.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -E "^\||MHA|Error|error" | tail -40
fi
