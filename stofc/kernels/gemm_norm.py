"""GEMM + LayerNorm / RMSNorm (family ``gemm_norm``): the GEMM template with a norm epilogue.

``out = norm(epilogue(A @ Wᵀ))`` in one kernel: the block's tile spans the full
output row (``bn >= N``, at most one MMA column group per warp wasted), so the
row statistics are reduced in shared memory without a second pass. The search
space and the analytical default are :mod:`stofc.kernels.gemm`'s norm branch
(``space`` / ``default_config`` read the epilogue's norm); this module registers
the template for ``gemm_norm`` segments.
"""

from __future__ import annotations

from stofc.kernels.gemm import GemmTemplateFamily
from stofc.kernels.registry import register


@register
class GemmNorm(GemmTemplateFamily):
    """``gemm_norm`` segments on the hand-written GEMM template (full-row tiles)."""

    name = "gemm_norm"
    segments = ("gemm_norm",)
