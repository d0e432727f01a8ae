"""How long ``stofc compile``'s check takes (issue 16): the bundled example and BERT-base
shapes (12 layers, hidden 768, 12 heads, FFN 3072, 512 positions), each compiled twice so the
second compile runs with warm kernel and library caches; prints one line per model.

    PYTHONPATH=. python bench/compile_check_time.py [--out DIR]

No GPU needed (the check runs on ONNX Runtime's CPU EP).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from build_model import build_model

from stofc.package.selfcheck import check_len
from stofc.pipeline import Instruments, compile_model

MASK = "bigbird:block=16,window=3,global=1,random=1,seed=0"
MODELS = {
    "example": (dict(), 128),
    "bert-base shapes": (dict(layers=12, hidden=768, heads=12, ffn=3072, seq=512, vocab=30522),
                         512),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="stofc-check-time-"))
    root.mkdir(parents=True, exist_ok=True)
    for name, (kwargs, max_len) in MODELS.items():
        model = root / f"{name.replace(' ', '_')}.onnx"
        onnx.save(build_model(**kwargs), str(model), save_as_external_data=True,
                  location=f"{model.name}.data")
        for attempt in ("cold", "warm"):
            ins = Instruments(progress=False)
            start = time.perf_counter()
            compile_model(model, MASK, max_seq_len=max_len, out_dir=root / f"{model.stem}.stofc",
                          instruments=ins)
            total = time.perf_counter() - start
            check = ins.nested["check package (CPU EP)"]
            print(f"{name:<18} {attempt}: check {check:6.2f} s of compile {total:6.2f} s "
                  f"(B=2, L={check_len(max_len)})", flush=True)


if __name__ == "__main__":
    main()
