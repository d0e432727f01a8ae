"""A package's fingerprint: everything a refactor must leave unchanged, as plain JSON.

``fingerprint(pkg)`` digests what ``stofc compile`` wrote, byte for byte where the
bytes depend only on stofc: ``plan.json`` (without ``provenance``: tool versions,
creation time, the source model's path), every rendered kernel source
(``kernels/*.cu``), the mask binaries and attention launch plans (``masks/*.bin``),
the mask formats' arrays (``masks/*.npz``: a zip stamps member times, so the arrays
are hashed, not the file) and ``model.onnx`` (its deterministic serialisation).
Binaries NVRTC and g++ produce (cubins, PTX, ``libstofc_ort.so``) follow from the
sources and compiler versions, so they are not part of it.

``lowered_fingerprint(model, emitted)`` is the same for a rewritten model alone (the
exporter fixtures, whose head_dim 16 no attention kernel implements, are rewritten
for the CPU twins only).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def model_digest(model: onnx.ModelProto) -> str:
    """sha256 of the model's deterministic protobuf serialisation."""
    return _sha(model.SerializeToString(deterministic=True))


def _npz_digest(path: Path) -> str:
    h = hashlib.sha256()
    with np.load(path, allow_pickle=False) as data:
        for name in sorted(data.files):
            arr = data[name]
            h.update(f"{name}:{arr.dtype.str}:{arr.shape}".encode())
            h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def fingerprint(pkg: Path) -> dict[str, Any]:
    """The fingerprint of the package in ``pkg`` (see the module doc)."""
    doc = json.loads((pkg / "plan.json").read_text())
    doc.pop("provenance", None)
    files: dict[str, str] = {}
    for path in sorted(pkg.rglob("*")):
        rel = path.relative_to(pkg).as_posix()
        if path.suffix == ".cu" or rel.endswith(".bin"):
            files[rel] = _sha(path.read_bytes())
        elif path.suffix == ".npz":
            files[rel] = _npz_digest(path)
    files["model.onnx"] = model_digest(onnx.load(str(pkg / "model.onnx")))
    return {"plan.json": doc, "files": files}


def lowered_fingerprint(model: onnx.ModelProto, emitted: tuple) -> dict[str, Any]:
    """The fingerprint of a rewritten model and how its segments were emitted."""
    return {"model.onnx": model_digest(model), "segments": [e.to_dict() for e in emitted]}
