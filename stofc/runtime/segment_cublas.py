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


# cuBLASLt: the GEMM with its bias (+ReLU) and residual (as C, beta = 1) folded in.
_LT_TRANSA, _LT_TRANSB, _LT_EPILOGUE, _LT_BIAS_POINTER = 3, 4, 7, 8
_LT_PREF_MAX_WORKSPACE = 1
_EPI_DEFAULT, _EPI_RELU, _EPI_BIAS, _EPI_RELU_BIAS = 1, 2, 4, 6
_HEURISTIC_BYTES = 96  # cublasLtMatmulHeuristicResult_t: algo[64], size_t, int, float, int[4]


def lt_split(bias: bool, act: str, residual: bool) -> tuple[int, bool]:
    """``(cuBLASLt epilogue code, whether it also applies act)`` for what Lt can fold.

    Lt computes ``act(A B + beta C + bias)``: the residual (C) can join only when no
    activation follows the bias (our order is act(AB + bias) + residual).
    """
    if act == "relu" and not residual:
        return (_EPI_RELU_BIAS if bias else _EPI_RELU), True
    return (_EPI_BIAS if bias else _EPI_DEFAULT), act == "none"


class CublasLt:
    """A cuBLASLt handle, workspace and per-shape matmul plans (descriptors + algorithm)."""

    def __init__(self) -> None:
        import cupy
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib
            lib = ctypes.CDLL(load_nvidia_dynamic_lib("cublasLt").abs_path)
        except Exception:
            lib = ctypes.CDLL("libcublasLt.so.13")
        vp = ctypes.c_void_p
        for fn in ("cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescSetAttribute",
                   "cublasLtMatrixLayoutCreate", "cublasLtMatmulPreferenceCreate",
                   "cublasLtMatmulPreferenceSetAttribute", "cublasLtMatmulAlgoGetHeuristic",
                   "cublasLtMatmul"):
            getattr(lib, fn).restype = ctypes.c_int
        lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, ctypes.c_int, vp, ctypes.c_size_t]
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_int,
                                                   ctypes.c_uint64, ctypes.c_uint64,
                                                   ctypes.c_int64]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, ctypes.c_int, vp,
                                                             ctypes.c_size_t]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                                       vp, ctypes.POINTER(ctypes.c_int)]
        lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                                       ctypes.c_size_t, vp]
        self.lib = lib
        self.handle = vp()
        Cublas._check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = cupy.empty(_WORKSPACE, dtype=cupy.uint8)
        self._plans: dict[tuple, tuple] = {}
        self._one = ctypes.c_float(1.0)
        self._zero = ctypes.c_float(0.0)

    def _set(self, desc, attr: int, value) -> None:
        Cublas._check(self.lib.cublasLtMatmulDescSetAttribute(
            desc, attr, ctypes.c_void_p(ctypes.addressof(value)), ctypes.sizeof(value)),
            "cublasLtMatmulDescSetAttribute")

    def _layout(self, code: int, rows: int, cols: int, ld: int):
        layout = ctypes.c_void_p()
        Cublas._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), code, rows, cols,
                                                          ld), "cublasLtMatrixLayoutCreate")
        return layout

    def _plan(self, m: int, n: int, k: int, code: int, epilogue: int, bias_ptr: int):
        key = (m, n, k, code, epilogue)
        if key in self._plans:
            return self._plans[key]
        lib, vp = self.lib, ctypes.c_void_p
        desc = vp()
        Cublas._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, 0),
                      "cublasLtMatmulDescCreate")
        self._set(desc, _LT_TRANSA, ctypes.c_int32(_OP_T))
        self._set(desc, _LT_TRANSB, ctypes.c_int32(_OP_N))
        self._set(desc, _LT_EPILOGUE, ctypes.c_uint32(epilogue))
        if bias_ptr:
            self._set(desc, _LT_BIAS_POINTER, ctypes.c_void_p(bias_ptr))
        a = self._layout(code, k, n, k)   # W [N, K] row-major = col-major K x N, op T
        b = self._layout(code, k, m, k)   # x [M, K] row-major = col-major K x M
        c = self._layout(code, n, m, n)   # out [M, N] row-major = col-major N x M
        pref = vp()
        Cublas._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)),
                      "cublasLtMatmulPreferenceCreate")
        size = ctypes.c_uint64(_WORKSPACE)
        Cublas._check(lib.cublasLtMatmulPreferenceSetAttribute(
            pref, _LT_PREF_MAX_WORKSPACE, vp(ctypes.addressof(size)), 8),
            "cublasLtMatmulPreferenceSetAttribute")
        heuristic = (ctypes.c_ubyte * _HEURISTIC_BYTES)()
        count = ctypes.c_int(0)
        Cublas._check(lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, desc, a, b, c, c, pref, 1, vp(ctypes.addressof(heuristic)),
            ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        if count.value < 1:
            raise DeviceError(f"cuBLASLt has no algorithm for {m}x{n}x{k} epilogue {epilogue}",
                              hint="use the cuBLAS + epilogue kernel path")
        self._plans[key] = (desc, a, b, c, heuristic)
        return self._plans[key]

    def matmul(self, x: Any, w_nk: Any, out: Any, dtype: str, stream_ptr: int, *,
               bias: Any = None, epilogue: int = _EPI_DEFAULT, residual: Any = None) -> None:
        """``out = lt_epilogue(x @ w_nkᵀ + residual + bias)`` on ``stream_ptr`` (capturable)."""
        m, k = x.shape
        n = w_nk.shape[0]
        code = _CUDA_R_16F if dtype == "float16" else _CUDA_R_16BF
        bias_ptr = bias.data.ptr if bias is not None else 0
        desc, a, b, c, heuristic = self._plan(m, n, k, code, epilogue, bias_ptr)
        if bias_ptr:
            self._set(desc, _LT_BIAS_POINTER, ctypes.c_void_p(bias_ptr))
        vp = ctypes.c_void_p
        beta = self._one if residual is not None else self._zero
        c_ptr = residual.data.ptr if residual is not None else out.data.ptr
        Cublas._check(self.lib.cublasLtMatmul(
            self.handle, desc, vp(ctypes.addressof(self._one)), vp(w_nk.data.ptr), a,
            vp(x.data.ptr), b, vp(ctypes.addressof(beta)), vp(c_ptr), c, vp(out.data.ptr), c,
            vp(ctypes.addressof(heuristic)), vp(self.workspace.data.ptr), _WORKSPACE,
            vp(stream_ptr)), "cublasLtMatmul")


_LT_HANDLES: dict[int, CublasLt] = {}


def lt_handle() -> CublasLt:
    """The cuBLASLt handle for the current device (created on first use)."""
    import cupy
    dev = cupy.cuda.Device().id
    if dev not in _LT_HANDLES:
        _LT_HANDLES[dev] = CublasLt()
    return _LT_HANDLES[dev]
