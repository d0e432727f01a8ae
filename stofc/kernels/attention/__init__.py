"""Sparse attention kernels: configs and search spaces, rendering, the selector, oracles.

* :mod:`.config` - :class:`AttentionConfig`, :class:`KernelSpec`, ``search_space``, ``prune``
* :mod:`.render` - ``render_kernel`` / ``compile_kernel`` (templates/attention/*.cu.j2)
* :mod:`.select` - ``select_kernel`` -> :class:`KernelChoice`
* :mod:`.reference` - ``format_from_dense``, ``reference_attention`` (float64)

The GPU runtime lives in :mod:`stofc.runtime.attention` (``AttentionOp``).
"""

from stofc.kernels.attention.config import (
    DTYPES,
    HEAD_DIMS,
    AttentionConfig,
    KernelSpec,
    prune,
    search_space,
    smem_bytes,
)
from stofc.kernels.attention.reference import (
    dense_from_format,
    format_from_dense,
    reference_attention,
)
from stofc.kernels.attention.render import compile_kernel, render_kernel
from stofc.kernels.attention.select import KernelChoice, select_kernel, stof_threshold

__all__ = [
    "DTYPES", "HEAD_DIMS", "AttentionConfig", "KernelChoice", "KernelSpec", "compile_kernel",
    "dense_from_format", "format_from_dense", "prune", "reference_attention", "render_kernel",
    "search_space", "select_kernel", "smem_bytes", "stof_threshold",
]
