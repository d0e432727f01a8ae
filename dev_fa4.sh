cat .fa4/r3/part3 >> /tmp/fa4.tar
mkdir -p /tmp/w && tar -xf /tmp/fa4.tar -C /tmp/w && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fa4site /tmp/w/*.whl || echo "fa4 install failed"
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 170 python3 bench/ws_variants.py --cases "1:16:8192:128:bf16 1:16:16384:128:bf16" --masks dense,causal,cw4095,local256,longformer,bigbird --variants base,q1,c3np,c3np_q1 2>&1 | grep '^{' | tee $OUT/q2-d128.jsonl | cut -c1-220
timeout 300 python3 bench/mha_hopper.py 2>&1 | tail -45
