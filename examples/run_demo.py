"""The demo behind ``make demo``: build a small BERT-like model and take it through stofc.

Runs, printing each command first (no GPU needed, about a minute on a laptop):

1. ``examples/build_model.py``: a 2-layer BERT-like encoder as ONNX (no torch);
2. ``stofc inspect``: the attention blocks, layer chains and fusion segments found;
3. ``stofc mask stats`` / ``stofc mask show``: the BigBird mask, its tiles and a picture;
4. ``stofc compile``: the package (fp16, cubins for sm_90 plus PTX, custom-op library);
5. ``stofc verify``: the package on ONNX Runtime's CPU EP against the original model
   with the structured mask injected (bound 1e-2);
6. ``examples/load_in_ort.py``: the two-line ONNX Runtime loading.

Usage: ``python examples/run_demo.py --out out/demo``
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MASK = "bigbird:block=16,window=3,global=1,random=2,seed=0"
MAX_LEN = 128


def run(*cmd: str) -> None:
    """Print and run one command; stop the demo when it fails."""
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    result = subprocess.run(cmd, check=False)
    if result.returncode != 0:
        print(f"demo: the command above failed (exit {result.returncode})", file=sys.stderr)
        sys.exit(result.returncode)
    print(f"  ({time.perf_counter() - start:.1f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="output directory")
    parser.add_argument("--mask", default=MASK, help="mask spec (MASKS.md)")
    ns = parser.parse_args()
    out = ns.out
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    stofc = (py, "-m", "stofc")
    model, package = out / "model.onnx", out / "model.stofc"
    run(py, str(HERE / "build_model.py"), "-o", str(model), "--seq", str(MAX_LEN))
    run(*stofc, "inspect", str(model), "--mask", ns.mask)
    run(*stofc, "mask", "stats", ns.mask, "-L", str(MAX_LEN), "--tile", "64", "--head-dim", "32")
    run(*stofc, "mask", "show", ns.mask, "-L", str(MAX_LEN), "-o", str(out / "mask.png"))
    run(*stofc, "compile", str(model), "--mask", ns.mask, "--gpu", "h100", "--dtype", "fp16",
        "--max-seq-len", str(MAX_LEN), "-o", str(package))
    run(*stofc, "verify", str(package), "--provider", "cpu", "--batch", "2", "--seq-len", "128",
        "--seq-len", "45")
    run(py, str(HERE / "load_in_ort.py"), str(package))
    print(f"\ndemo done: package in {package}, mask picture in {out / 'mask.png'}")


if __name__ == "__main__":
    main()
