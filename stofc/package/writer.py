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

import onnx

from stofc import __version__
from stofc.cachecheck import check_binary
from stofc.codegen import Source
from stofc.compile import CompiledKernel
from stofc.frontend.types import ModelGraph
from stofc.fsutil import umask
from stofc.masks import save as save_mask
from stofc.masks.format import MaskFormat
from stofc.package import emit
from stofc.package.cuda_launch import annotate_cuda
from stofc.package.destination import write_directory
from stofc.package.kernels import AttentionKernel, compile_options
from stofc.package.manifest import build_manifest, sha256_file, write_manifest
from stofc.package.maskbin import write_mask_binary
from stofc.package.rewrite import AttentionBinding, attention_inputs, rewrite_model
from stofc.plan.plan import Plan
from stofc.targets import GpuProfile

PLAN_FORMAT = "stofc-package-plan"
PLAN_FILE_VERSION = 1
MODEL_FILE = "model.onnx"
EXTERNAL_DATA_BYTES = 1 << 30   # above this, weights go to model.onnx.data (protobuf limit: 2 GiB)


@dataclass(frozen=True, eq=False)
class PackageContents:
    """Everything the earlier stages produced that goes into a package."""

    graph: ModelGraph
    plan: Plan
    profile: GpuProfile
    mask_text: str                                   # the spec as the user gave it
    mask_canonical: str                              # the effective spec (canonical JSON)
    mask_causal_from_model: bool                     # causal ANDed in (the model is causal)
    formats: dict[int, MaskFormat]                   # per layer
    segment_sources: dict[tuple[int, int], tuple[Source, ...]]
    attention: dict[int, AttentionKernel]            # per layer
    compiled: dict[tuple[str, str], CompiledKernel]  # (source name, target)
    targets: tuple[str, ...]                         # (cubin arch, ptx target)
    source_model: Path
    tuned: bool = False
    pack_qkv: bool = True   # one [K, 3N] Q|K|V FusedGemm per layer (rewrite_model)
    buckets: tuple[tuple[int, Plan], ...] = ()       # tuned (length, plan): FusedGemm lt_algo
    pack_projections: bool = False  # graph's Q, K, V projections packed (stofc.frontend.pack)


def kernel_file(name: str, target: str) -> str:
    suffix = "ptx" if target.startswith("compute_") else "cubin"
    return f"kernels/{name}.{target}.{suffix}"


def mask_id(fmt: MaskFormat) -> str:
    return f"mask-{fmt.spec_hash[:16]}"


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


def _provenance(contents: PackageContents) -> dict:
    import onnx as onnx_mod

    from stofc.compile import nvrtc_version
    try:
        import onnxruntime
        ort_version: str | None = onnxruntime.__version__
    except ImportError:
        ort_version = None
    return {"stofc": __version__, "nvrtc": nvrtc_version(), "driver": _driver_version(),
            "onnx": onnx_mod.__version__, "onnxruntime": ort_version,
            "python": platform.python_version(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "tuned": contents.tuned,
            "source_model": str(contents.source_model.resolve()),
            "source_model_sha256": sha256_file(contents.source_model)}


def launch_attributes(ak: AttentionKernel) -> tuple[tuple[str, int], ...]:
    """SparseAttention's launch attributes (OPS.md): threads, blocks per tile row, smem.

    The CUDA twin launches with them (``kernel_abi`` 3, cuda/ort/attention_abi.h).
    """
    return _launch(ak.choice.config, ak.spec.head_dim)


def _launch(cfg, head_dim: int) -> tuple[tuple[str, int], ...]:
    from stofc.package.cuda_launch import attention_launch_numbers

    threads, per_row, smem = attention_launch_numbers(cfg, head_dim)
    return (("block_threads", threads), ("blocks_per_tile_row", per_row),
            ("smem_bytes", smem))


def variant_attributes(ak: AttentionKernel, arch: str) -> tuple[tuple[str, object], ...]:
    """SparseAttention's run-time variant attributes (OPS.md), ``()`` without variants.

    ``variant_launch_plans`` is added by :func:`~stofc.package.cuda_launch.annotate_cuda`,
    which writes the plan files.
    """
    if not ak.variants:
        return ()
    launches = [dict(_launch(v.choice.config, v.spec.head_dim)) for v in ak.variants]
    return (
        ("variant_kernels", ";".join(f"{kernel_file(v.source.name, arch)}:"
                                     f"{v.source.entry_points[0]}" for v in ak.variants)),
        *((f"variant_{key}", [launch[key] for launch in launches])
          for key in ("block_threads", "blocks_per_tile_row", "smem_bytes")),
        ("variant_max_seq_len", [v.max_seq_len for v in ak.variants]),
        ("variant_max_batch_rows", [v.max_batch_rows for v in ak.variants]),
    )


def write_kernel(root: Path, src: Source, compiled: dict[tuple[str, str], CompiledKernel],
                 targets: tuple[str, ...]) -> dict:
    """Write ``src`` and its binary per package target under ``root/kernels``; return its
    plan.json ``kernels`` entry (docs/plan-schema.md)."""
    (root / "kernels" / f"{src.name}.cu").write_text(src.code)
    files = {"cu": f"kernels/{src.name}.cu"}
    for target in targets:
        rel = kernel_file(src.name, target)
        kernel = compiled[(src.name, target)]
        check_binary(kernel.binary, target, src.name, sha256=kernel.sha256 or None)
        (root / rel).write_bytes(kernel.binary)
        files[target] = rel
    return {"name": src.name, "template": src.template, "entry_points": list(src.entry_points),
            "params": {k: v for k, v in src.params},
            "nvrtc_options": list(compile_options(src)), "files": files,
            "nvrtc_targets": {t: compiled[(src.name, t)].target for t in targets}}


def _write_kernels(root: Path, contents: PackageContents) -> list[dict]:
    sources = {s.name: s for srcs in contents.segment_sources.values() for s in srcs}
    sources.update({src.name: src for a in contents.attention.values() for src in a.sources})
    (root / "kernels").mkdir()
    return [write_kernel(root, sources[name], contents.compiled, contents.targets)
            for name in sorted(sources)]


def _write_masks(root: Path, contents: PackageContents) -> list[dict]:
    (root / "masks").mkdir()
    by_id: dict[str, dict] = {}
    for layer, fmt in sorted(contents.formats.items()):
        mid = mask_id(fmt)
        if mid not in by_id:
            save_mask(fmt, root / "masks" / f"{mid}.npz")
            os.chmod(write_mask_binary(fmt, root / "masks" / f"{mid}.bin"), 0o666 & ~umask())
            by_id[mid] = {"id": mid, "npz": f"masks/{mid}.npz", "bin": f"masks/{mid}.bin",
                          "spec": json.loads(fmt.spec), "spec_hash": fmt.spec_hash,
                          "seq_len": fmt.seq_len, "tile": fmt.tile, "num_heads": fmt.num_heads,
                          "nnz": fmt.nnz, "density": fmt.density, "layers": []}
        by_id[mid]["layers"].append(layer)
    return list(by_id.values())


def _save_model(model: onnx.ModelProto, root: Path) -> None:
    path = root / MODEL_FILE
    if model.ByteSize() > EXTERNAL_DATA_BYTES:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=f"{MODEL_FILE}.data", size_threshold=1024)
    else:
        onnx.save_model(model, str(path))


def _fill(root: Path, contents: PackageContents, *, ort_include: str | Path | None) -> None:
    from stofc.package.ortlib import build_library

    graph, plan, profile = contents.graph, contents.plan, contents.profile
    arch = contents.targets[0]
    kernel_entries = _write_kernels(root, contents)
    mask_entries = _write_masks(root, contents)
    refs = {key: f"{kernel_file(srcs[0].name, arch)}:{srcs[0].entry_points[0]}"
            for key, srcs in contents.segment_sources.items()}
    bindings: dict[int, AttentionBinding] = {}
    attention_entries = []
    for layer, ak in sorted(contents.attention.items()):
        kpm, bias = attention_inputs(graph.layers[layer].attention, graph)
        fmt = contents.formats[layer]
        bindings[layer] = AttentionBinding(
            layer, f"masks/{mask_id(fmt)}.bin",
            f"{kernel_file(ak.source.name, arch)}:{ak.source.entry_points[0]}", kpm, bias,
            launch_attributes(ak) + variant_attributes(ak, arch))
        attention_entries.append({
            "layer": layer, "kernel": ak.choice.kernel, "config": asdict(ak.choice.config),
            "explanation": ak.choice.explanation, "stof_threshold": ak.choice.stof_threshold,
            "estimate_us": {"block": ak.choice.block_us, "row": ak.choice.row_us},
            "source": ak.source.name, "mask": mask_id(fmt), "has_bias": ak.spec.has_bias,
            "has_key_bits": ak.spec.has_key_bits, "key_padding_mask": kpm, "bias": bias,
            "launch": dict(launch_attributes(ak)), "kernel_abi": emit.KERNEL_ABI,
            "variants": [{"max_seq_len": v.max_seq_len, "max_batch_rows": v.max_batch_rows,
                          "kernel": v.choice.kernel, "config": asdict(v.choice.config),
                          "source": v.source.name, "why": v.reason,
                          "launch": dict(_launch(v.choice.config, v.spec.head_dim))}
                         for v in ak.variants]})
    model, emitted = rewrite_model(graph, plan, refs, bindings, pack_qkv=contents.pack_qkv)
    kernel_entries += annotate_cuda(model, root, contents, emitted)  # the CUDA twins' launches
    _save_model(model, root)
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
        "attention": attention_entries,
        "segments": [dict(e.to_dict(), kernel=refs.get((e.layer, e.ordinal))
                          or (bindings[e.layer].kernel if e.family == "attention" else None))
                     for e in emitted],
        "kernels": kernel_entries,
        "targets": list(contents.targets),
        "gpu": {**asdict(profile), "arch": profile.arch, "ptx_target": profile.ptx_target},
        "provenance": _provenance(contents),
    }
    (root / "plan.json").write_text(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
    build_library(root, ort_include=ort_include)
    write_manifest(root, build_manifest(root, stofc=__version__, gpu=profile.name, arch=arch,
                                        ptx=contents.targets[-1], dtype=plan.dtype))


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
