"""cuBLAS for the vendor path, called through ctypes so it can be captured in CUDA graphs.

CuPy refuses cuBLAS calls while a stream is capturing; the library itself
allows them when the handle has its own workspace (``cublasSetWorkspace``),
so this module drives ``cublasGemmEx`` directly: ``out[M, N] = x[M, K] @
w[N, K]ᵀ`` (row-major), fp16 or bf16 operands, fp32 accumulation
(``CUBLAS_COMPUTE_32F``). One handle and one 32 MiB workspace per device.
"""

from __future__ import annotations

import ctypes
from typing import Any

from stofc.errors import DeviceError

_CUDA_R_16F, _CUDA_R_16BF = 2, 14
_OP_N, _OP_T = 0, 1
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1
_WORKSPACE = 32 * 1024 * 1024


def _library() -> ctypes.CDLL:
    errors = []
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        return ctypes.CDLL(load_nvidia_dynamic_lib("cublas").abs_path)
    except Exception as err:  # fall back to the loader's search path
        errors.append(str(err).splitlines()[0])
    for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so"):
        try:
            return ctypes.CDLL(name)
        except OSError as err:
            errors.append(str(err))
    raise DeviceError(f"cuBLAS not found ({'; '.join(errors)})",
                      hint="install nvidia-cublas (the CUDA 13 wheels) for the vendor path")


class Cublas:
    """A cuBLAS handle with its own workspace on the current device."""

    def __init__(self) -> None:
        import cupy
        lib = _library()
        vp, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
        lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, f, vp, i, i, vp, i, i, f, vp, i, i, i, i]
        for fn in ("cublasCreate_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2",
                   "cublasGemmEx"):
            getattr(lib, fn).restype = ctypes.c_int
        self.lib = lib
        self.handle = vp()
        self._check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self.workspace = cupy.empty(_WORKSPACE, dtype=cupy.uint8)
        self._check(lib.cublasSetWorkspace_v2(self.handle, vp(self.workspace.data.ptr),
                                              _WORKSPACE), "cublasSetWorkspace")
        self._alpha = ctypes.c_float(1.0)
        self._beta = ctypes.c_float(0.0)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise DeviceError(f"{what} failed with cuBLAS status {status}",
                              hint="check the GPU and the operand shapes")

    def gemm(self, x: Any, w_nk: Any, out: Any, dtype: str, stream_ptr: int) -> None:
        """``out = x @ w_nkᵀ`` on the stream ``stream_ptr`` (capturable)."""
        m, k = x.shape
        n = w_nk.shape[0]
        code = _CUDA_R_16F if dtype == "float16" else _CUDA_R_16BF
        vp = ctypes.c_void_p
        self._check(self.lib.cublasSetStream_v2(self.handle, vp(stream_ptr)), "cublasSetStream")
        self._check(self.lib.cublasGemmEx(
            self.handle, _OP_T, _OP_N, n, m, k, vp(ctypes.addressof(self._alpha)),
            vp(w_nk.data.ptr), code, k, vp(x.data.ptr), code, k,
            vp(ctypes.addressof(self._beta)), vp(out.data.ptr), code, n, _COMPUTE_32F,
            _GEMM_DEFAULT), "cublasGemmEx")


_HANDLES: dict[int, Cublas] = {}


def handle() -> Cublas:
    """The handle for the current device (created on first use)."""
    import cupy
    dev = cupy.cuda.Device().id
    if dev not in _HANDLES:
        _HANDLES[dev] = Cublas()
    return _HANDLES[dev]
