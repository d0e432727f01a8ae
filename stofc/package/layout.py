"""Where things are in a package directory: the one module holding the layout's names.

::

    model.onnx          the model rewritten to ai.stofc ops (+ model.onnx.data when large)
    plan.json           plan, kernels, mask formats, GPU profile, provenance
    kernels/            NAME.cu, NAME.sm_XY.cubin, NAME.compute_XY.ptx
    masks/              mask-ID.npz, mask-ID.bin (OPS.md layout), mask-ID.KEY.plan.bin
    libstofc_ort.so     the custom-op library (stofc.package.ortlib.build_library)
    manifest.json       sha256 of every other file (stofc.package.manifest)
"""

from __future__ import annotations

from typing import Protocol

MODEL_FILE = "model.onnx"
PLAN_FILE = "plan.json"
MANIFEST = "manifest.json"
LIBRARY_NAME = "libstofc_ort.so"
PLAN_FORMAT = "stofc-package-plan"
PLAN_FILE_VERSION = 1


class _HasHash(Protocol):
    @property
    def spec_hash(self) -> str: ...


def kernel_file(name: str, target: str) -> str:
    """A kernel's binary for one target: ``kernels/NAME.sm_XY.cubin`` or ``.compute_XY.ptx``."""
    suffix = "ptx" if target.startswith("compute_") else "cubin"
    return f"kernels/{name}.{target}.{suffix}"


def source_file(name: str) -> str:
    """A kernel's CUDA source: ``kernels/NAME.cu``."""
    return f"kernels/{name}.cu"


def mask_id(fmt: _HasHash) -> str:
    """The file stem of a mask format: ``mask-`` and 16 hex digits of its hash."""
    return f"mask-{fmt.spec_hash[:16]}"


def mask_files(fmt: _HasHash) -> tuple[str, str]:
    """``(masks/ID.npz, masks/ID.bin)`` of a mask format."""
    mid = mask_id(fmt)
    return f"masks/{mid}.npz", f"masks/{mid}.bin"


def launch_plan_file(fmt: _HasHash, key: str) -> str:
    """The attention launch data (``*.plan.bin``) of one launch key on a mask format."""
    return f"masks/{mask_id(fmt)}.{key}.plan.bin"
