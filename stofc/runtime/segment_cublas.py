"""cuBLAS for the vendor path, called through ctypes so it can be captured in CUDA graphs.

CuPy refuses cuBLAS calls while a stream is capturing; the library itself
allows them when the handle has its own workspace (``cublasSetWorkspace``),
so this module drives ``cublasGemmEx`` directly: ``out[M, N] = x[M, K] @
w[N, K]ᵀ`` (row-major), fp16 or bf16 operands, fp32 accumulation
(``CUBLAS_COMPUTE_32F``). One handle and one 32 MiB workspace per device.

:class:`CublasLt` is the vendor path the plans use: the same descriptors as the
ORT library's ``FusedGemm`` (``w [K, N]``), an epilogue, and a choice among the
heuristic's candidates (``algo_rank``, tuned per segment: ``lt_algo`` / ``lt_m``).
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from typing import Any

from stofc.errors import DeviceError

_CUDA_R_16F, _CUDA_R_16BF = 2, 14
_OP_N, _OP_T = 0, 1
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1
_WORKSPACE = 32 * 1024 * 1024    # the plain cuBLAS handle's (cublasSetWorkspace: capturable)
# cuBLASLt's workspace: the heuristic's MAX_WORKSPACE_BYTES preference and what cublasLtMatmul
# gets. None: at 32 MiB the heuristic's first choice for the BERT-base QKV GEMM (8192 x 2304 x
# 768) and for 4096-16384 x 3072 x 768 zeroes its workspace with a Memset before every call, one
# more launch and kernel boundary (~3 us a layer in the package); with no workspace it picks the
# stream-scheduled ("ssched") twin of the same tile config, 1-1.5 us faster in GPU time with the
# memset counted, and the same kernel for every other shape measured (M 128-16384, BERT-base's
# four GEMMs; one split-K pick at 128 x 768 x 3072 was 0.1 us faster with the workspace):
# bench/results/lt-workspace-ab-{h100,h200}-2026-11-27.jsonl. The ORT twin's kLtMaxWorkspace
# (cuda/ort/cublas_lt.h) must equal it, so a tuned rank names one algorithm on both sides.
LT_WORKSPACE = 0


def _library() -> ctypes.CDLL:
    errors = []
    try:
        # optional: cuda-pathfinder, the GPU extras
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
        import cupy  # optional: CuPy, the GPU extras
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
    import cupy  # optional: CuPy, the GPU extras
    dev = cupy.cuda.Device().id
    if dev not in _HANDLES:
        _HANDLES[dev] = Cublas()
    return _HANDLES[dev]


# cuBLASLt: the GEMM with its bias (+ReLU or tanh-GELU) and residual (as C, beta = 1) folded in.
_LT_TRANSA, _LT_TRANSB, _LT_EPILOGUE, _LT_BIAS_POINTER = 3, 4, 7, 8
_LT_PREF_MAX_WORKSPACE = 1
_CUDA_R_32F = 0
_EPI_DEFAULT, _EPI_RELU, _EPI_BIAS, _EPI_RELU_BIAS = 1, 2, 4, 6
# cuBLASLt's GELU epilogue is the tanh form 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
# so it folds "gelu_tanh" only; erf-GELU stays with the Add+Norm kernel (never approximated).
_EPI_GELU, _EPI_GELU_BIAS = 32, 36
_HEURISTIC_BYTES = 96  # cublasLtMatmulHeuristicResult_t: algo[64], size_t, int, float, int[4]


class LtRankUnavailable(DeviceError):
    """cuBLASLt's heuristic returned fewer candidates than a requested rank needs."""


def lt_split(bias: bool, act: str, residual: bool) -> tuple[int, bool]:
    """``(cuBLASLt epilogue code, whether it also applies act)`` for what Lt can fold.

    Lt computes ``act(A B + beta C + bias)``: the residual (C) can join only when no
    activation follows the bias (our order is act(AB + bias) + residual). Lt applies
    ReLU and the tanh GELU (``gelu_tanh``, its GELU epilogue's formula) itself when no
    residual follows; ``gelu_erf`` is never replaced by the tanh form.
    """
    if act == "relu" and not residual:
        return (_EPI_RELU_BIAS if bias else _EPI_RELU), True
    if act == "gelu_tanh" and not residual:
        return (_EPI_GELU_BIAS if bias else _EPI_GELU), True
    return (_EPI_BIAS if bias else _EPI_DEFAULT), act == "none"


def chosen_result(rank: int, returned: int) -> int:
    """The heuristic result used for ``rank``: number ``rank``, or the last one returned.

    The contract of the ORT twin (``FusedGemm``'s ``lt_algo_rank``): ask for
    ``rank + 1`` results, use result ``rank`` (0-based), or the last when fewer came back.
    """
    if rank < 0:
        raise ValueError(f"cuBLASLt algorithm rank {rank} is negative")
    if returned < 1:
        raise ValueError("the cuBLASLt heuristic returned no algorithm")
    return min(rank, returned - 1)


def _lt_library() -> ctypes.CDLL:
    """cuBLASLt: ``$STOFC_CUBLASLT`` first (as the ORT library), then the CUDA wheels, then
    the loader's search path. Tuner and ORT library should load the same file (ranks)."""
    errors = []
    env = os.environ.get("STOFC_CUBLASLT")
    if env:
        try:
            return ctypes.CDLL(env)
        except OSError as err:
            errors.append(str(err))
    try:
        # optional: cuda-pathfinder, the GPU extras
        from cuda.pathfinder import load_nvidia_dynamic_lib
        return ctypes.CDLL(load_nvidia_dynamic_lib("cublasLt").abs_path)
    except Exception as err:  # fall back to the loader's search path (as the ORT library)
        errors.append(str(err).splitlines()[0])
    for name in ("libcublasLt.so.13", "libcublasLt.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError as err:
            errors.append(str(err))
    raise DeviceError(f"cuBLASLt not found ({'; '.join(errors)})",
                      hint="install nvidia-cublas (the CUDA 13 wheels) for the vendor path")


@functools.cache
def lt_version() -> int | None:
    """``cublasLtGetVersion()`` of the library the vendor path loads (no GPU needed), or None.

    A heuristic rank names an algorithm only for one cuBLASLt version, so the
    tuner keys vendor measurements by it.
    """
    try:
        lib = _lt_library()
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        lib.cublasLtGetVersion.argtypes = []
        return int(lib.cublasLtGetVersion())
    except Exception:
        return None


@dataclass
class LtPlan:
    """One shape's descriptors, the chosen heuristic result and how many came back."""

    desc: Any
    a: Any
    b: Any
    c: Any
    heuristic: Any          # the chosen cublasLtMatmulHeuristicResult_t (96 bytes)
    returned: int           # results the heuristic returned for rank + 1 requested
    rank: int               # the rank asked for


class CublasLt:
    """A cuBLASLt handle, workspace and per-shape matmul plans (descriptors + algorithm).

    The descriptors are exactly those of ``FusedGemm`` in
    ``cuda/ort/cuda_gemm_norm.cc``, so heuristic rank r is the same algorithm
    here and in the ORT library: compute ``CUBLAS_COMPUTE_32F`` with fp32
    scale, ``opN``/``opN``, column-major views of the row-major operands
    (``w [K, N]`` as A ``N x K`` ld N, ``x [M, K]`` as B ``K x M`` ld K,
    ``out [M, N]`` as C and D ``N x M`` ld N), the epilogue, the bias pointer set
    before the heuristic, and a workspace preference of :data:`LT_WORKSPACE` bytes.

    ``lib`` / ``workspace`` (a device pointer) let tests drive it with a fake
    library and no GPU; by default the real library and, where ``LT_WORKSPACE`` is
    not 0, a CuPy buffer of that size (none now: the matmul gets a null workspace).
    """

    def __init__(self, lib: Any = None, workspace: int | None = None) -> None:
        if lib is None:
            lib = _lt_library()
        vp = ctypes.c_void_p
        for fn in ("cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescSetAttribute",
                   "cublasLtMatrixLayoutCreate", "cublasLtMatmulPreferenceCreate",
                   "cublasLtMatmulPreferenceSetAttribute", "cublasLtMatmulAlgoGetHeuristic",
                   "cublasLtMatmul"):
            getattr(lib, fn).restype = ctypes.c_int
        lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int]
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
        self._workspace_bytes = LT_WORKSPACE
        if workspace is None and self._workspace_bytes:
            import cupy  # optional: CuPy, the GPU extras
            self.workspace = cupy.empty(self._workspace_bytes, dtype=cupy.uint8)
            workspace = int(self.workspace.data.ptr)
        self._workspace_ptr = workspace or 0
        self._plans: dict[tuple, LtPlan] = {}
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

    def plan(self, m: int, n: int, k: int, code: int, epilogue: int, bias_ptr: int,
             rank: int = 0) -> LtPlan:
        """The shape's descriptors and heuristic result ``chosen_result(rank, returned)``.

        Created once per (shape, dtype, epilogue, rank); the heuristic is asked
        for ``rank + 1`` results, as the ORT twin does.
        """
        key = (m, n, k, code, epilogue, rank)
        if key in self._plans:
            return self._plans[key]
        lib, vp = self.lib, ctypes.c_void_p
        desc = vp()
        Cublas._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _CUDA_R_32F),
                      "cublasLtMatmulDescCreate")
        self._set(desc, _LT_TRANSA, ctypes.c_int32(_OP_N))
        self._set(desc, _LT_TRANSB, ctypes.c_int32(_OP_N))
        self._set(desc, _LT_EPILOGUE, ctypes.c_uint32(epilogue))
        if bias_ptr:  # set before the heuristic, as the ORT twin does
            self._set(desc, _LT_BIAS_POINTER, ctypes.c_void_p(bias_ptr))
        a = self._layout(code, n, k, n)   # w [K, N] row-major = col-major N x K, op N
        b = self._layout(code, k, m, k)   # x [M, K] row-major = col-major K x M
        c = self._layout(code, n, m, n)   # out [M, N] row-major = col-major N x M
        pref = vp()
        Cublas._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)),
                      "cublasLtMatmulPreferenceCreate")
        size = ctypes.c_uint64(self._workspace_bytes)
        Cublas._check(lib.cublasLtMatmulPreferenceSetAttribute(
            pref, _LT_PREF_MAX_WORKSPACE, vp(ctypes.addressof(size)), ctypes.sizeof(size)),
            "cublasLtMatmulPreferenceSetAttribute")
        requested = rank + 1
        words = _HEURISTIC_BYTES // 8     # uint64 buffers: the algo struct is 8-byte aligned
        results = (ctypes.c_uint64 * (words * requested))()
        count = ctypes.c_int(0)
        Cublas._check(lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, desc, a, b, c, c, pref, requested, vp(ctypes.addressof(results)),
            ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        if count.value < 1:
            raise DeviceError(f"cuBLASLt has no algorithm for {m}x{n}x{k} epilogue {epilogue}",
                              hint="use the cuBLAS + epilogue kernel path")
        returned = min(count.value, requested)
        start = words * chosen_result(rank, returned)
        heuristic = (ctypes.c_uint64 * words)(*results[start:start + words])
        self._plans[key] = LtPlan(desc, a, b, c, heuristic, returned, rank)
        return self._plans[key]

    def matmul(self, x: Any, w_kn: Any, out: Any, dtype: str, stream_ptr: int, *,
               bias: Any = None, epilogue: int = _EPI_DEFAULT, residual: Any = None,
               algo_rank: int = 0, exact_rank: bool = False) -> None:
        """``out = lt_epilogue(x @ w_kn + residual + bias)`` on ``stream_ptr`` (capturable).

        ``w_kn``: the weight ``[K, N]`` row-major (the ONNX / ORT layout).
        ``algo_rank``: the heuristic result to use (:func:`chosen_result`). With
        ``exact_rank`` a rank the heuristic did not return raises
        :class:`LtRankUnavailable` instead (the tuner: not a distinct candidate).
        """
        m, k = x.shape
        if w_kn.shape[0] != k:
            raise DeviceError(f"cuBLASLt weight is {list(w_kn.shape)}, expected [{k}, N] "
                              f"for x {list(x.shape)}", hint="pass the weight as [K, N]")
        n = w_kn.shape[1]
        code = _CUDA_R_16F if dtype == "float16" else _CUDA_R_16BF
        bias_ptr = bias.data.ptr if bias is not None else 0
        plan = self.plan(m, n, k, code, epilogue, bias_ptr, algo_rank)
        if exact_rank and plan.returned <= algo_rank:
            raise LtRankUnavailable(
                f"cuBLASLt's heuristic returned {plan.returned} algorithm(s) for {m}x{n}x{k} "
                f"epilogue {epilogue}, so rank {algo_rank} is not a distinct candidate",
                hint="choose a rank below the number the heuristic returns")
        if bias_ptr:
            self._set(plan.desc, _LT_BIAS_POINTER, ctypes.c_void_p(bias_ptr))
        vp = ctypes.c_void_p
        beta = self._one if residual is not None else self._zero
        c_ptr = residual.data.ptr if residual is not None else out.data.ptr
        Cublas._check(self.lib.cublasLtMatmul(
            self.handle, plan.desc, vp(ctypes.addressof(self._one)), vp(w_kn.data.ptr), plan.a,
            vp(x.data.ptr), plan.b, vp(ctypes.addressof(beta)), vp(c_ptr), plan.c,
            vp(out.data.ptr), plan.c, vp(ctypes.addressof(plan.heuristic)),
            vp(self._workspace_ptr or None), self._workspace_bytes, vp(stream_ptr)),
            "cublasLtMatmul")


_LT_HANDLES: dict[int, CublasLt] = {}


def lt_handle() -> CublasLt:
    """The cuBLASLt handle for the current device (created on first use)."""
    import cupy  # optional: CuPy, the GPU extras
    dev = cupy.cuda.Device().id
    if dev not in _LT_HANDLES:
        _LT_HANDLES[dev] = CublasLt()
    return _LT_HANDLES[dev]
