#!/bin/bash
# Source on the device machine after the onnxruntime-gpu wheel was assembled at
# /tmp/ortgpu.whl (README "Running on a GPU"): checks it, installs it once beside the
# image's packages (/tmp/ortsite) and exports what the project needs to use it.
# Env: WHEEL_SHA256 (required the first time).
whl=/tmp/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
if [ ! -d /tmp/ortsite/onnxruntime ]; then
  echo "${WHEEL_SHA256:?set WHEEL_SHA256}  /tmp/ortgpu.whl" | sha256sum -c - || return 3
  cp /tmp/ortgpu.whl "$whl"
  python3 -m pip install -q --no-index --no-deps --target /tmp/ortsite "$whl" || return 4
fi
export PYTHONPATH=/tmp/ortsite:.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export STOFC_CACHE_DIR=${STOFC_CACHE_DIR:-/tmp/stofc-cache}
[ -d "$PWD/.ortinc" ] && export STOFC_ORT_INCLUDE=$PWD/.ortinc
LD_LIBRARY_PATH=$(find /opt/torch/.venv/lib/python3.12/site-packages/nvidia -name lib -type d | tr '\n' :)
export LD_LIBRARY_PATH
# one cuBLASLt for the tuner (Python) and the ORT library, so a tuned heuristic rank
# names the same algorithm in both (stofc/tune/spaces.py "lt_algo")
STOFC_CUBLASLT=$(find /opt/torch/.venv/lib/python3.12/site-packages/nvidia -name 'libcublasLt.so.1[0-9]' | head -1)
export STOFC_CUBLASLT
python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
