"""Segment runner (CuPy): execute one planned segment, or a layer's chain, on device tensors.

For tests, the tuner and benchmarks. :class:`SegmentRunner` takes a layer, its
:class:`~stofc.plan.plan.LayerPlan` and the layer's parameters (ONNX layouts,
any float dtype), puts the parameters on the GPU in the plan's dtype (GEMM
weights transposed once to ``[N, K]``; a cuBLASLt vendor segment also gets a
``[K, N]`` copy of its weight when compiled, the layout the ORT library's
``FusedGemm`` passes, so the same heuristic rank is the same algorithm there),
renders and compiles every segment's kernel (NVRTC, cached) and loads the
cubins. Parameters are read-only once the runner is built. ``run_segment`` reads its inputs
from a ``{value name: cupy array}`` dict and writes its outputs into it.

Activations are 2-D ``[tokens, features]`` arrays; a projection stored with
``store="heads"`` is written as ``[G, B, H, S, D]``. bf16 tensors are held as
``uint16`` arrays of raw bits (CuPy has no bf16 dtype): use :func:`to_device`
and :func:`to_host` to convert. Wrong shapes or dtypes raise
:class:`SegmentInputError` naming the value, the expected and the actual.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from stofc.compile import compile_source
from stofc.errors import StofcError
from stofc.frontend.types import Layer, OpKind
from stofc.kernels import catalog
from stofc.kernels.attention.family import AttentionFamily
from stofc.plan.plan import LayerPlan, Segment
from stofc.runtime import executors_glu  # noqa: F401  (registers the gated activation's executor)
from stofc.runtime.executors import Loaded, executor_for, runs_here
from stofc.runtime.module import _cupy
from stofc.runtime.segment_cublas import handle, lt_handle


class SegmentInputError(StofcError):
    """A tensor handed to the segment runner has the wrong shape or dtype."""


def storage_dtype(dtype: str) -> np.dtype:
    """The CuPy/numpy dtype that holds ``dtype`` (bf16 as raw ``uint16`` bits)."""
    return np.dtype(np.float16) if dtype == "float16" else np.dtype(np.uint16)


def to_bits(array: np.ndarray, dtype: str) -> np.ndarray:
    """Host float array -> host storage array (bf16: round to nearest even)."""
    if dtype == "float16":
        return np.ascontiguousarray(array, dtype=np.float16)
    f = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = f + 0x7FFF + ((f >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def from_bits(array: np.ndarray, dtype: str) -> np.ndarray:
    """Host storage array -> float32."""
    if dtype == "float16":
        return np.asarray(array, dtype=np.float32)
    return (np.asarray(array, dtype=np.uint32) << 16).view(np.float32)


def to_device(array: np.ndarray, dtype: str):
    """A host float array on the GPU in ``dtype`` storage."""
    return _cupy().asarray(to_bits(np.asarray(array), dtype))


def to_host(array, dtype: str) -> np.ndarray:
    """A device array in ``dtype`` storage -> host float32."""
    return from_bits(_cupy().asnumpy(array), dtype)


def _load(source: Any, arch: str, smem: int) -> tuple[Any, Any]:
    """Compile ``source`` for ``arch`` (NVRTC, cached) and load it; (module, function)."""
    cupy = _cupy()
    compiled = compile_source(source, arch)
    module = cupy.cuda.function.Module()
    module.load(compiled.binary)
    function = module.get_function(source.entry_points[0])
    if smem > 48 * 1024:
        drv = cupy.cuda.driver
        drv.funcSetAttribute(function.ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                             smem)
    return module, function


class SegmentRunner:
    """Compiled kernels and device parameters for one layer plan.

    ``compile_only``: render and compile every kernel into the NVRTC cache, load
    nothing and touch no GPU (the tuner's compile pool builds candidates so).
    """

    def __init__(self, layer: Layer, plan: LayerPlan, weights: dict[str, np.ndarray], *,
                 dtype: str, arch: str | None = None, use_lt: bool = True,
                 compile_only: bool = False) -> None:
        self.layer, self.plan, self.dtype = layer, plan, dtype
        self.storage = storage_dtype(dtype)
        self.compile_only = compile_only
        self.poison = False  # fill outputs with NaN before each launch (tests: unwritten = NaN)
        self.use_lt = use_lt  # vendor path through cuBLASLt epilogues when available
        # tuner: a cuBLASLt rank the heuristic did not return raises LtRankUnavailable
        self.lt_exact_rank = False
        self._kn: dict[str, tuple[Any, Any]] = {}  # weight name -> ([N, K] source, [K, N] copy)
        self._modules: list[Any] = []
        self.params: dict[str, Any] = {}
        self.kernels: dict[int, Loaded] = {}
        if compile_only:
            self.arch = arch or "sm_90"
            return
        cupy = _cupy()
        if arch is None:
            arch = f"sm_{cupy.cuda.Device().compute_capability}"
        self.arch = arch
        for op in layer.chain:
            for key in ("bias", "scale"):
                name = op.param(key)
                if isinstance(name, str):
                    self.params[name] = to_device(np.asarray(weights[name]).reshape(-1), dtype)
            if op.kind == OpKind.GEMM:
                w = np.asarray(weights[op.param("weight")])
                nk = w.T if op.param("weight_layout", "KN") == "KN" else w
                self.params[op.param("weight")] = to_device(np.ascontiguousarray(nk), dtype)
        self._dummy = cupy.zeros(8, dtype=self.storage)
        for seg in plan.segments:
            if runs_here(seg):
                self.kernels[seg.ordinal] = self._compile(seg)

    # -- compilation ---------------------------------------------------------------
    def _compile(self, seg: Segment) -> Loaded:
        return executor_for(seg).compile(self, seg)

    def load(self, source: Any, smem: int) -> Any:
        """Compile ``source`` for the runner's arch and load it (``compile_only``: compile)."""
        if self.compile_only:
            compile_source(source, self.arch)
            return None
        module, function = _load(source, self.arch, smem)
        self._modules.append(module)
        return function

    def lt(self) -> Any:
        """The cuBLASLt handle, or None where it is unavailable (then plain cuBLAS)."""
        if self.compile_only:
            return _NO_LT_CALLS
        try:
            return lt_handle()
        except Exception:  # no cuBLASLt: the plain cuBLAS path
            self.use_lt = False
            return None

    def cublas_gemm(self, x: Any, w_nk: Any, out: Any, *, stream: Any = None) -> None:
        cublas_gemm(x, w_nk, out, self.dtype, stream=stream)

    def _weight_kn(self, name: str | None, w_nk: Any) -> Any:
        """The ``[K, N]`` copy of the ``[N, K]`` weight ``w_nk`` (made once per array)."""
        cache = self.__dict__.setdefault("_kn", {})
        held = cache.get(name)
        if held is not None and held[0] is w_nk:
            return held[1]
        kn = _cupy().ascontiguousarray(w_nk.T)
        cache[name] = (w_nk, kn)
        return kn

    # -- checks --------------------------------------------------------------------
    def _get(self, values: dict[str, Any], seg: Segment, slot: str, shape: tuple[int, ...]):
        name = seg.binding(slot)
        if name is None:
            return self._dummy
        if name in self.params:
            arr = self.params[name]
        elif name in values:
            arr = values[name]
        else:
            raise SegmentInputError(f"segment {seg.ordinal} needs value {name!r} ({slot})",
                                    hint="run the producing segment first or pass it in values")
        if tuple(arr.shape) != shape or arr.dtype != self.storage:
            raise SegmentInputError(
                f"segment {seg.ordinal} input {name!r} ({slot}) is {arr.dtype}{list(arr.shape)}, "
                f"expected {self.storage}{list(shape)}",
                hint=f"pass a contiguous {self.dtype} tensor of that shape (bf16 as uint16 bits)")
        if not arr.flags.c_contiguous:
            raise SegmentInputError(f"segment {seg.ordinal} input {name!r} is not contiguous",
                                    hint="pass cupy.ascontiguousarray(x)")
        return arr

    # -- execution -----------------------------------------------------------------
    def run_segment(self, seg: Segment, values: dict[str, Any], *, batch: int, seq_len: int,
                    stream=None) -> None:
        """Run one non-attention segment; outputs are allocated and stored in ``values``."""
        _cupy()
        loaded = self.kernels.get(seg.ordinal)
        if loaded is None:
            raise SegmentInputError(f"segment {seg.ordinal} ({seg.family}) has no kernel here",
                                    hint="attention segments run through the attention runner")
        executor_for(seg).run(self, loaded, seg, values, batch=batch, seq_len=seq_len,
                              stream=stream)

    def gemm_outputs(self, seg: Segment, batch: int, seq_len: int, n: int) -> tuple[Any, Any]:
        """A GEMM segment's output (``[M, N]``, or ``[G, B, H, S, D]`` for the heads store)
        and its pre-norm output (the dummy when not stored)."""
        m = batch * seq_len
        heads, head_dim = self.layer.attention.num_heads, self.layer.attention.head_dim
        if seg.kernel.param("store", "row") == "heads":
            if n % (heads * head_dim):
                raise SegmentInputError(f"heads store needs N={n} divisible by H*D",
                                        hint="use store='row'")
            out = self._empty((n // (heads * head_dim), batch, heads, seq_len, head_dim))
        else:
            out = self._empty((m, n))
        pre = self._empty((m, n)) if seg.epilogues[-1].store_pre_norm else self._dummy
        return out, pre

    def _empty(self, shape, dtype=None):
        cupy = _cupy()
        dtype = self.storage if dtype is None else dtype
        if not self.poison:
            return cupy.empty(shape, dtype=dtype)
        nan_bits = 0x7E00 if self.dtype == "float16" else 0x7FC0
        return cupy.full(shape, nan_bits, dtype=np.uint16).view(dtype)

    def _launch_norm(self, loaded, seg, values, x, out, pre, m, n, stream,
                     bias_slot: str | None = None) -> None:
        cfg = loaded.config
        if bias_slot is None:
            bias_slot = "b0" if seg.binding("b0") else "bias"
        args = (x, self._get(values, seg, bias_slot, (n,)),
                self._get(values, seg, "residual", (m, n)), self._get(values, seg, "gamma", (n,)),
                self._get(values, seg, "beta", (n,)), out, pre, np.int32(m), np.int32(n),
                np.float32(seg.epsilon))
        loaded.function((-(-m // cfg.rows), 1, 1), (loaded.threads, 1, 1), args, stream=stream)

    def _store(self, values, seg: Segment, out, pre) -> None:
        values[seg.binding("out")] = out
        if pre is not None and seg.binding("pre_norm_out"):
            values[seg.binding("pre_norm_out")] = pre

    def run_chain(self, values: dict[str, Any], *, batch: int, seq_len: int,
                  attention: Callable[[Segment, dict[str, Any]], Any] | None = None,
                  stream=None) -> dict[str, Any]:
        """Run every segment in order; ``attention(segment, values)`` returns an attention
        segment's output."""
        for seg in self.plan.segments:
            if isinstance(catalog.segment_kind(seg.family), AttentionFamily):
                if attention is None:
                    raise SegmentInputError("the chain has an attention segment",
                                            hint="pass attention=callable(segment, values)")
                values[seg.outputs[0]] = attention(seg, values)
            else:
                self.run_segment(seg, values, batch=batch, seq_len=seq_len, stream=stream)
        return values


class _NoLtCalls:
    """What ``lt()`` gives a compile-only runner: a handle that is never called."""


_NO_LT_CALLS = _NoLtCalls()


def cublas_gemm(x, w_nk, out, dtype: str, *, stream=None) -> None:
    """``out[M, N] = x[M, K] @ w_nk[N, K]ᵀ`` through cublasGemmEx (fp32 accumulation).

    Called through ctypes (:mod:`stofc.runtime.segment_cublas`) so that it can
    be captured in a CUDA graph together with the fused epilogue kernels.
    """
    ptr = stream.ptr if stream is not None else _cupy().cuda.get_current_stream().ptr
    handle().gemm(x, w_nk, out, dtype, ptr)
