"""The registered kernel families, loaded: what the planner, tuner, renderer and runtimes ask.

Importing this module imports every built-in family module (each registers itself
with :func:`~stofc.kernels.registry.register`), so its lookups always see them all.
A new family is one module under ``stofc/kernels/`` and one import line here.

* :func:`family` - by name; :func:`families` - all of them;
* :func:`families_for` - those executing a segment kind, by preference;
* :func:`segment_kind` - the family answering for a segment kind's problem shape,
  widths and float64 reference (the first registered for it);
* :func:`family_of` - the family that wrote a plan's KernelSpec;
* :func:`family_of_params` - whose a tuner config of a merged space is;
* :func:`default_kernel` - a segment's analytical default KernelSpec.
"""

from __future__ import annotations

from stofc.kernels import (
    embed_norm,
    gemm,
    gemm_gemm,
    gemm_norm,
    gemm_ws,
    glu,
    norm,
    ort,
    rotary,
    vendor_gemm,
)
from stofc.kernels.attention import block, row, ws
from stofc.kernels.registry import (
    KernelFamily,
    default_kernel,
    families,
    families_for,
    family,
    family_of,
    family_of_params,
)

BUILTIN = (gemm, gemm_norm, vendor_gemm, gemm_gemm, gemm_ws, glu, norm, embed_norm, ort, rotary, block, row,
           ws)


def segment_kind(kind: str) -> KernelFamily:
    """The family that answers for segment kind ``kind`` (its first, by preference)."""
    found = families_for(kind)
    if not found:
        raise ValueError(f"no kernel family runs {kind!r} segments")
    return found[0]


__all__ = ["BUILTIN", "default_kernel", "families", "families_for", "family", "family_of",
           "family_of_params", "segment_kind"]
