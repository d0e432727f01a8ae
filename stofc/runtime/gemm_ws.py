"""Launches of the Hopper GEMM (:mod:`stofc.kernels.gemm_ws`) on CuPy arrays.

:func:`load_gemm_ws` compiles (NVRTC, cached) and loads the kernel for a problem;
:func:`bind_gemm_ws` packs one launch on fixed buffers: the x and w tensor maps (64 x 64
boxes, 128-byte swizzle, rank 4 with unit outer extents, as the ORT twin encodes them),
the bias, the output and the extents. The arrays must be contiguous, 16-byte aligned,
``x [M, K]``, ``w [K, N]``, ``bias [N]`` and ``out [M, N]`` of the problem's dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stofc.compile import compile_source
from stofc.errors import DeviceError
from stofc.kernels.gemm_ws import (
    COMPILE_OPTIONS,
    DEFAULT,
    TARGET,
    THREADS,
    GemmWsConfig,
    GemmWsProblem,
    check_shape,
    entry_name,
    gemm_ws_grid,
    render_gemm_ws,
)
from stofc.runtime.module import BoundLaunch, LoadedKernel, load_kernel
from stofc.runtime.tensor_map import encode_tiled

_BOX = (64, 64, 1, 1)


def load_gemm_ws(problem: GemmWsProblem, config: GemmWsConfig = DEFAULT) -> LoadedKernel:
    """The kernel for ``problem``, compiled for sm_90a and loaded on the current device."""
    compiled = compile_source(render_gemm_ws(problem, config), TARGET, options=COMPILE_OPTIONS)
    return load_kernel(compiled, entry_name(problem, config), dynamic_smem=config.smem_bytes())


def _map(array: Any, dtype: str) -> Any:
    rows, cols = array.shape
    pitch = cols * 2
    return encode_tiled(int(array.data.ptr), dtype, (cols, rows, 1, 1),
                        (pitch, pitch * rows, pitch * rows), _BOX)


def bind_gemm_ws(kernel: LoadedKernel, problem: GemmWsProblem, x: Any, w: Any, bias: Any,
                 out: Any, *, sms: int, config: GemmWsConfig = DEFAULT) -> BoundLaunch:
    """One launch computing ``out = act(x @ w + bias)`` (bias ignored when the problem has
    none; pass any array of the dtype). DeviceError on a shape or layout it cannot take."""
    (m, k), (k2, n) = x.shape, w.shape
    if k2 != k or out.shape != (m, n) or (problem.has_bias and bias.shape != (n,)):
        raise DeviceError(f"shapes x {x.shape}, w {w.shape}, bias {bias.shape}, out "
                          f"{out.shape} do not form x @ w + bias", hint="check the operands")
    for name, a in (("x", x), ("w", w), ("out", out), ("bias", bias)):
        if not a.flags.c_contiguous or int(a.data.ptr) % 16:
            raise DeviceError(f"{name} must be contiguous and 16-byte aligned",
                              hint="pass a contiguous copy")
    try:
        check_shape(m, n, k)
    except Exception as err:
        raise DeviceError(str(err), hint="use the cuBLASLt path for this node") from None
    return BoundLaunch(kernel, gemm_ws_grid(m, n, sms, config), THREADS,
                       (_map(x, problem.dtype), _map(w, problem.dtype), bias, out,
                        np.int32(m), np.int32(n), np.int32(k)))
