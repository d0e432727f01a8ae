#!/bin/bash
# One device call (after bench/ort_env.sh): `stofc verify --provider cuda` of BERT-base
# (BigBird) and GPT-2-small (Longformer, ANDed with its causal mask) packages at every
# issue-7 shape, so both run-time attention kernels are checked end to end: (1, 128) and
# (2, 512) take the query-split variant (B x tile rows <= 32 on an H200), (8, 512) and
# (4, 2048) the unsplit base kernel. Logs under $OUT.
set -o pipefail
OUT=${OUT:-/tmp/out}; W=${W:-/tmp/stofc-verify}; mkdir -p "$OUT" "$W"
python3 - <<PY
import sys; sys.path.insert(0, "bench")
from pathlib import Path
import e2e_models as m
for name, fn in (("bert", m.export_bert), ("gpt2", m.export_gpt2)):
    p = Path("$W") / f"{name}.onnx"
    if not p.exists():
        fn(p)
PY
cases="--batch 1 --seq-len 128 --batch 2 --seq-len 512 --batch 8 --seq-len 512 --batch 4 --seq-len 2048"
for spec in "bert bigbird:block=64,window=3,global=2,random=3,seed=0" "gpt2 longformer:window=128,global=32"; do
  set -- $spec
  python3 -m stofc compile "$W/$1.onnx" --mask "$2" --gpu auto --max-seq-len 2048 -o "$W/$1.stofc" --quiet \
    && python3 -m stofc verify "$W/$1.stofc" --provider cuda $cases 2>&1 | tee "$OUT/verify-$1.log"
done
