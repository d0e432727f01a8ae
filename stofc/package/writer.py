"""``write_package``: the pipeline's last stage, a deployable ONNX Runtime package on disk.

Layout of a package directory (``docs/plan-schema.md`` documents ``plan.json``)::

    model.onnx          the model rewritten to ai.stofc ops (+ model.onnx.data when large)
    plan.json           plan, kernels, mask formats, GPU profile, provenance
    kernels/            NAME.cu, NAME.sm_XY.cubin, NAME.compute_XY.ptx
    masks/              mask-ID.npz (stofc.masks.save) and mask-ID.bin (OPS.md layout)
    libstofc_ort.so     the custom-op library (stofc.package.ortlib.build_library)
    manifest.json       sha256 of every other file (stofc.package.manifest)

Atomic (:mod:`stofc.package.destination`): everything is written into a locked
temporary directory next to the destination, checked (the package runs on ONNX
Runtime's CPU EP and matches the model, :mod:`stofc.package.selfcheck`), and
then swapped into place. On any failure the temporary directory is removed and
an existing package stays as it was. A destination that exists and is neither
empty nor a verified stofc package is refused (a PackageError naming the file
that is not the package's), so a typo in ``-o`` never deletes anyone's files.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import onnx

from stofc.cachecheck import check_binary
from stofc.codegen import RenderedKernel
from stofc.compile import CompiledKernel, nvrtc_version
from stofc.frontend.types import ModelGraph
from stofc.fsutil import umask
from stofc.lower.emit import KERNEL_ABI
from stofc.lower.program import Program
from stofc.masks import save as save_mask
from stofc.package.destination import write_directory
from stofc.package.layout import (
    MODEL_FILE,
    PLAN_FILE,
    PLAN_FILE_VERSION,
    PLAN_FORMAT,
    kernel_file,
    mask_files,
    mask_id,
    source_file,
)
from stofc.package.manifest import build_manifest, sha256_file, write_manifest
from stofc.package.maskbin import write_attention_plan, write_mask_binary
from stofc.package.ortlib import build_library
from stofc.version import __version__

EXTERNAL_DATA_BYTES = 1 << 30   # above this, weights go to model.onnx.data (protobuf limit: 2 GiB)
TWIN_PURPOSE = "CUDA twin epilogue (OPS.md)"


@dataclass(frozen=True, eq=False)
class PackageContents:
    """Everything the earlier stages produced that goes into a package.

    ``program``: the lowered plan (:class:`~stofc.lower.program.Program`);
    ``rendered``: its kernels, then its twins' epilogue kernels, rendered; ``compiled``:
    their binaries by ``(name, package target)``.
    """

    graph: ModelGraph
    program: Program
    rendered: tuple[RenderedKernel, ...]
    compiled: dict[tuple[str, str], CompiledKernel]
    mask_text: str                                   # the spec as the user gave it
    mask_canonical: str                              # the effective spec (canonical JSON)
    mask_causal_from_model: bool                     # causal ANDed in (the model is causal)
    source_model: Path
    pack_projections: bool = False  # graph's Q, K, V projections packed (stofc.frontend.pack)


def _driver_version() -> str | None:
    """The NVIDIA kernel driver's version from /proc (no GPU access), if installed."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    for word in text.split():
        if word.count(".") in (1, 2) and word.replace(".", "").isdigit():
            return word
    return None


def _provenance(contents: PackageContents) -> dict[str, Any]:
    try:
        import onnxruntime  # optional: the provenance says which one, if any
        ort_version: str | None = onnxruntime.__version__
    except ImportError:
        ort_version = None
    return {"stofc": __version__, "nvrtc": nvrtc_version(), "driver": _driver_version(),
            "onnx": onnx.__version__, "onnxruntime": ort_version,
            "python": platform.python_version(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "tuned": contents.program.tuned,
            "source_model": str(contents.source_model.resolve()),
            "source_model_sha256": sha256_file(contents.source_model)}


def write_kernel(root: Path, kernel: RenderedKernel,
                 compiled: dict[tuple[str, str], CompiledKernel],
                 targets: tuple[str, ...]) -> dict[str, Any]:
    """Write ``kernel``'s source and its binary per package target under ``root/kernels``;
    return its plan.json ``kernels`` entry (docs/plan-schema.md)."""
    src = kernel.source
    (root / source_file(src.name)).write_text(src.code)
    files = {"cu": source_file(src.name)}
    for target in targets:
        rel = kernel_file(src.name, target)
        compiled_kernel = compiled[(src.name, target)]
        check_binary(compiled_kernel.binary, target, src.name,
                     sha256=compiled_kernel.sha256 or None)
        (root / rel).write_bytes(compiled_kernel.binary)
        files[target] = rel
    return {"name": src.name, "template": src.template, "entry_points": list(src.entry_points),
            "params": {k: v for k, v in src.params},
            "nvrtc_options": list(kernel.options), "files": files,
            "nvrtc_targets": {t: compiled[(src.name, t)].target for t in targets}}


def _write_masks(root: Path, program: Program) -> list[dict[str, Any]]:
    (root / "masks").mkdir()
    by_id: dict[str, dict[str, Any]] = {}
    for layer, fmt in sorted(program.masks.formats.items()):
        mid = mask_id(fmt)
        if mid not in by_id:
            npz, mbin = mask_files(fmt)
            save_mask(fmt, root / npz)
            os.chmod(write_mask_binary(fmt, root / mbin), 0o666 & ~umask())
            by_id[mid] = {"id": mid, "npz": npz, "bin": mbin,
                          "spec": json.loads(fmt.spec), "spec_hash": fmt.spec_hash,
                          "seq_len": fmt.seq_len, "tile": fmt.tile, "num_heads": fmt.num_heads,
                          "nnz": fmt.nnz, "density": fmt.density, "layers": []}
        by_id[mid]["layers"].append(layer)
    for rel, data in program.launch_plans:
        write_attention_plan(data, root / rel)
    return list(by_id.values())


def _attention_entries(program: Program) -> list[dict[str, Any]]:
    entries = []
    for layer, ak in sorted(program.attention.items()):
        c = ak.choice
        entries.append({
            "layer": layer, "kernel": c.kernel, "config": asdict(c.config),
            "explanation": c.explanation, "stof_threshold": c.stof_threshold,
            "estimate_us": dict(c.estimates), "source": ak.instance(c).name,
            "mask": mask_id(ak.problem.fmt), "has_bias": ak.problem.has_bias,
            "has_key_bits": ak.problem.has_key_bits, "key_padding_mask": ak.key_padding_mask,
            "bias": ak.bias, "launch": dict(ak.launch(c)), "kernel_abi": KERNEL_ABI,
            "variants": [{"max_seq_len": v.max_seq_len, "max_batch_rows": v.max_batch_rows,
                          "kernel": v.choice.kernel, "config": asdict(v.choice.config),
                          "source": ak.instance(v.choice).name, "why": v.reason,
                          "launch": dict(ak.launch(v.choice))}
                         for v in ak.variants],
            "buckets": [{"seq_len": b.seq_len, "kernel": b.choice.kernel,
                         "config": asdict(b.choice.config),
                         "estimate_us": dict(b.choice.estimates + b.choice.refinements),
                         "explanation": b.choice.explanation, "launched": b.launched,
                         "variants": len(b.variants)}
                        for b in ak.buckets]})
    return entries


def _save_model(model: onnx.ModelProto, root: Path) -> None:
    path = root / MODEL_FILE
    if model.ByteSize() > EXTERNAL_DATA_BYTES:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=f"{MODEL_FILE}.data", size_threshold=1024)
    else:
        onnx.save_model(model, str(path))


def _fill(root: Path, contents: PackageContents, *, ort_include: str | Path | None) -> None:
    program, graph = contents.program, contents.graph
    plan, profile, targets = program.plan, program.profile, program.targets
    (root / "kernels").mkdir()
    twins = {k.name for k in program.twins}
    kernel_entries = [write_kernel(root, k, contents.compiled, targets)
                      for k in contents.rendered if k.name not in twins]
    kernel_entries += [{**write_kernel(root, k, contents.compiled, targets),
                        "purpose": TWIN_PURPOSE} for k in contents.rendered if k.name in twins]
    mask_entries = _write_masks(root, program)
    _save_model(program.model, root)
    doc = {
        "format": PLAN_FORMAT, "version": PLAN_FILE_VERSION,
        "plan": plan.to_dict(),
        "model": {"file": MODEL_FILE, "opset": graph.opset,
                  "inputs": [asdict(v) for v in graph.inputs],
                  "outputs": [asdict(v) for v in graph.outputs],
                  "layers": len(graph.layers), "pack_projections": contents.pack_projections,
                  "unsupported": [asdict(u) for u in graph.unsupported]},
        "mask": {"spec": contents.mask_text, "effective": json.loads(contents.mask_canonical),
                 "causal_from_model": contents.mask_causal_from_model, "formats": mask_entries},
        "attention": _attention_entries(program),
        "segments": [dict(e.to_dict(), kernel=program.refs.get((e.layer, e.ordinal)))
                     for e in program.emitted],
        "kernels": kernel_entries,
        "targets": list(targets),
        "gpu": {**asdict(profile), "arch": profile.arch, "ptx_target": profile.ptx_target},
        "provenance": _provenance(contents),
    }
    (root / PLAN_FILE).write_text(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
    build_library(root, ort_include=ort_include)
    write_manifest(root, build_manifest(root, stofc=__version__, gpu=profile.name,
                                        arch=program.arch, ptx=targets[-1], dtype=plan.dtype))


def write_package(out_dir: str | Path, contents: PackageContents, *,
                  ort_include: str | Path | None = None,
                  verify: Callable[[Path], None] | None = None,
                  protect: tuple[Path | None, ...] = ()) -> Path:
    """Write the package to ``out_dir`` atomically (see the module doc); returns the path.

    ``verify(tmp)`` runs on the complete package in its temporary directory before it
    is put in place (``stofc compile``'s check, :mod:`stofc.package.selfcheck`); if it
    raises, nothing is written. ``protect``: paths the compile reads, which ``out_dir``
    may not hold (:func:`~stofc.package.destination.check_destination`).
    """
    return write_directory(out_dir, lambda tmp: _fill(tmp, contents, ort_include=ort_include),
                           verify=verify, protect=(contents.source_model, *protect))
