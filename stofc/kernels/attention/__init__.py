"""Sparse attention kernels: the families, their configs and spaces, the selector, oracles.

* :mod:`.config` - :class:`AttentionConfig`, :class:`KernelSpec` (one rendered kernel),
  ``prune``, ``search_space``, ``smem_bytes`` (asking the config's family)
* :mod:`.family` - :class:`AttentionFamily`, the base of every attention kernel form,
  and :class:`AttentionProblem`
* :mod:`.block`, :mod:`.row`, :mod:`.ws` - the registered families (block-wise with its
  mma.sync and wgmma forms; row-wise; the warp-specialised Hopper kernel, runtime only so
  far): rules, cost models, launch
* :mod:`.select` - ``select_kernel`` -> :class:`KernelChoice`; ``choose_attention``
* :mod:`.launch` - ``launch_data``: what a kernel is launched with (runtime and package)
* :mod:`.render` - ``render_kernel`` / ``compile_kernel`` (templates/attention/*.cu.j2)
* :mod:`.reference` - ``format_from_dense``, ``reference_attention`` (float64)

Importing this package registers the attention families. The GPU runtime lives in
:mod:`stofc.runtime.attention` (``AttentionOp``).
"""

from stofc.kernels.attention import block, row, ws
from stofc.kernels.attention.config import (
    DTYPES,
    HEAD_DIMS,
    AttentionConfig,
    KernelSpec,
    attention_families,
    attention_family,
    prune,
    search_space,
    smem_bytes,
)
from stofc.kernels.attention.family import AttentionFamily, AttentionProblem
from stofc.kernels.attention.launch import AttentionLaunchData, launch_data
from stofc.kernels.attention.reference import (
    dense_from_format,
    format_from_dense,
    reference_attention,
)
from stofc.kernels.attention.render import compile_kernel, render_kernel
from stofc.kernels.attention.select import (
    AttentionVariant,
    KernelChoice,
    choose_attention,
    select_kernel,
    stof_threshold,
)

__all__ = [
    "DTYPES", "HEAD_DIMS", "AttentionConfig", "AttentionFamily", "AttentionLaunchData",
    "AttentionProblem", "AttentionVariant", "KernelChoice", "KernelSpec", "attention_families",
    "attention_family", "block", "choose_attention", "compile_kernel", "dense_from_format",
    "format_from_dense", "launch_data", "prune", "reference_attention", "render_kernel", "row",
    "search_space", "select_kernel", "smem_bytes", "stof_threshold", "ws",
]
