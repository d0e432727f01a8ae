"""Load a stofc package in plain ONNX Runtime (two lines) and with ``stofc.load``.

Usage: ``python examples/load_in_ort.py PACKAGE_DIR [--provider cpu|cuda]``

The two lines are all a deployment needs (no stofc import)::

    so = onnxruntime.SessionOptions(); so.register_custom_ops_library(f"{pkg}/libstofc_ort.so")
    sess = onnxruntime.InferenceSession(f"{pkg}/model.onnx", so, providers=[...])

``stofc.load(pkg)`` does the same after checking the package (manifest hashes,
kernels present, GPU architecture).
"""

from __future__ import annotations

import argparse

import numpy as np
import onnxruntime

import stofc


def main() -> None:
    parser = argparse.ArgumentParser(description="run a stofc package in ONNX Runtime")
    parser.add_argument("package")
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    ns = parser.parse_args()
    pkg = ns.package
    providers = ["CPUExecutionProvider"] if ns.provider == "cpu" else \
        ["CUDAExecutionProvider", "CPUExecutionProvider"]

    # The two lines:
    so = onnxruntime.SessionOptions(); so.register_custom_ops_library(f"{pkg}/libstofc_ort.so")  # noqa: E702
    sess = onnxruntime.InferenceSession(f"{pkg}/model.onnx", so, providers=providers)

    feeds = {}
    for inp in sess.get_inputs():
        if "int" in inp.type:
            feeds[inp.name] = (np.ones((2, 48), np.int64) if "mask" in inp.name
                               else np.random.default_rng(0).integers(0, 100, (2, 48)))
        else:
            raise SystemExit(f"this example feeds token models only (input {inp.name}: {inp.type})")
    feeds = {k: v.astype(np.int64) for k, v in feeds.items()}
    out = sess.run(None, feeds)
    print(f"two-line ORT load: {[o.name for o in sess.get_outputs()]} -> "
          f"{[tuple(o.shape) for o in out]} on {sess.get_providers()[0]}")

    checked = stofc.load(pkg, providers=providers)
    again = checked.run(None, feeds)
    same = all(np.array_equal(a, b) for a, b in zip(out, again, strict=True))
    print(f"stofc.load: package checked, same outputs: {same}")


if __name__ == "__main__":
    main()
