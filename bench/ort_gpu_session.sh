#!/bin/bash
# One device call, after the onnxruntime-gpu wheel was assembled at /tmp/ortgpu.whl
# (README "Running on a GPU"): install it beside the image's packages, run the
# CUDA-EP tests of the custom-op library, then compile a BERT-base-sized model and
# run `stofc verify --provider cuda` and `stofc bench` on it. Logs under $OUT.
# Env: WHEEL_SHA256 (required), STOFC_ORT_INCLUDE (ORT C API headers; the machine
# may have no network), MASK, CASES ("B:L B:L ..."), TEST_TIMEOUT, E2E_TIMEOUT.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
whl=/tmp/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
echo "${WHEEL_SHA256:?}  /tmp/ortgpu.whl" | sha256sum -c - || exit 3
cp /tmp/ortgpu.whl "$whl"
python3 -m pip install -q --no-index --no-deps --target /tmp/ortsite "$whl" || exit 4
export PYTHONPATH=/tmp/ortsite:.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 STOFC_CACHE_DIR=/tmp/stofc-cache
LD_LIBRARY_PATH=$(find /opt/torch/.venv/lib/python3.12/site-packages/nvidia -name lib -type d | tr '\n' :)
export LD_LIBRARY_PATH
python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())" \
  | tee "$OUT/ort.txt"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rfEs \
  tests/gpu/test_ort_cuda.py 2>&1 | tee "$OUT/ort-cuda-tests.log" | grep -v "^$" | tail -25
MASK=${MASK:-bigbird:block=64,window=3,global=2,random=3,seed=0}
python3 examples/build_model.py --layers 12 --hidden 768 --heads 12 --seq 2048 --vocab 30522 \
  -o /tmp/bert_base.onnx
timeout "${E2E_TIMEOUT:-240}" bash -c "
  python3 -m stofc compile /tmp/bert_base.onnx --mask '$MASK' --gpu auto --max-seq-len 2048 \
    -o /tmp/bert_base.stofc --quiet &&
  python3 -m stofc verify /tmp/bert_base.stofc --provider cuda --batch 1 --seq-len 128 \
    --batch 8 --seq-len 512 --batch 4 --seq-len 2048 &&
  python3 -m stofc bench /tmp/bert_base.stofc --batch 1 --seq-len 128 --batch 8 --seq-len 512 \
    --batch 4 --seq-len 2048 --json-out $OUT/e2e-bench.json --plot $OUT/e2e-bench.png
" 2>&1 | tee "$OUT/e2e.log" | tail -30
