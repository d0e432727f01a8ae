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

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from stofc.compile import compile_source
from stofc.errors import StofcError
from stofc.frontend.types import Layer, OpKind
from stofc.kernels import gemm as gemm_family
from stofc.kernels import gemm_gemm as gg_family
from stofc.kernels import norm as norm_family
from stofc.kernels.epilogue import Epilogue
from stofc.plan.plan import LayerPlan, Segment
from stofc.runtime.segment_cublas import lt_handle, lt_split


class SegmentInputError(StofcError):
    """A tensor handed to the segment runner has the wrong shape or dtype."""


def _cupy():
    import cupy
    return cupy


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


@dataclass
class _Loaded:
    function: Any
    smem: int
    threads: int
    config: Any
    kind: str  # "gemm" | "norm" | "gemm_gemm" | "vendor"


def _load(source, arch: str, smem: int):
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
    """Compiled kernels and device parameters for one layer plan."""

    def __init__(self, layer: Layer, plan: LayerPlan, weights: dict[str, np.ndarray], *,
                 dtype: str, arch: str | None = None, use_lt: bool = True) -> None:
        cupy = _cupy()
        if arch is None:
            arch = f"sm_{cupy.cuda.Device().compute_capability}"
        self.layer, self.plan, self.dtype, self.arch = layer, plan, dtype, arch
        self.storage = storage_dtype(dtype)
        self.params: dict[str, Any] = {}
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
        self.poison = False  # fill outputs with NaN before each launch (tests: unwritten = NaN)
        self.use_lt = use_lt  # vendor path through cuBLASLt epilogues when available
        # tuner: a cuBLASLt rank the heuristic did not return raises LtRankUnavailable
        self.lt_exact_rank = False
        self._kn: dict[str, tuple[Any, Any]] = {}  # weight name -> ([N, K] source, [K, N] copy)
        self._modules: list[Any] = []
        self.kernels: dict[int, _Loaded] = {}
        for seg in plan.segments:
            if seg.family != "attention":
                self.kernels[seg.ordinal] = self._compile(seg)

    # -- compilation ---------------------------------------------------------------
    def _compile(self, seg: Segment) -> _Loaded:
        spec, ep = seg.kernel, seg.epilogues[-1]
        tokens = 4096
        if spec.template == "vendor/cublas":
            return self._compile_vendor(seg)
        if seg.family == "add_norm":
            cfg = norm_family.NormConfig(spec.param("tpr"), spec.param("rows"))
            src = norm_family.render_norm(
                norm_family.NormProblem(tokens, seg.dim("n"), self.dtype, ep), cfg)
            mod, fn = _load(src, self.arch, 0)
            self._modules.append(mod)
            return _Loaded(fn, 0, cfg.tpr * cfg.rows, cfg, "norm")
        if seg.family in ("gemm", "gemm_norm"):
            cfg = gemm_family.GemmConfig(*(spec.param(k) for k in
                                           ("bm", "bn", "bk", "warps_m", "warps_n", "stages")))
            problem = gemm_family.GemmProblem(tokens, seg.dim("n0"), seg.dim("k0"), self.dtype, ep,
                                              spec.param("store", "row"))
            smem = cfg.smem_bytes(self.dtype)
            mod, fn = _load(gemm_family.render_gemm(problem, cfg), self.arch, smem)
            self._modules.append(mod)
            return _Loaded(fn, smem, cfg.threads, cfg, "gemm")
        if seg.family == "gemm_gemm":
            cfg2 = gg_family.GemmGemmConfig(*(spec.param(k) for k in
                                              ("bm", "bh", "bk", "warps", "stages")),
                                            split=spec.param("split", 1))
            problem2 = gg_family.GemmGemmProblem(tokens, seg.dim("k0"), seg.dim("n0"),
                                                 seg.dim("n1"), self.dtype, seg.epilogues[0],
                                                 seg.epilogues[1])
            smem = cfg2.smem_bytes(problem2)
            mod, fn = _load(gg_family.render_gemm_gemm(problem2, cfg2), self.arch, smem)
            self._modules.append(mod)
            finisher = None
            if cfg2.to_workspace(problem2):
                nprob = norm_family.NormProblem(tokens, problem2.n2, self.dtype, problem2.ep2,
                                                input_fp32=True)
                ncfg = norm_family.default_config(nprob, None)
                nmod, nfn = _load(norm_family.render_norm(nprob, ncfg), self.arch, 0)
                self._modules.append(nmod)
                finisher = _Loaded(nfn, 0, ncfg.tpr * ncfg.rows, ncfg, "norm")
            return _Loaded(fn, smem, cfg2.warps * 32, (cfg2, problem2, finisher), "gemm_gemm")
        raise SegmentInputError(f"segment family {seg.family!r} cannot run here",
                                hint="attention segments run through the attention runner")

    def _compile_vendor(self, seg: Segment) -> _Loaded:
        """cuBLASLt with what its epilogue can fold (bias, ReLU, residual as C), then the
        Add+Norm template for the rest; cuBLAS + the whole epilogue if Lt is unavailable.

        The spec's ``lt_algo`` (heuristic rank, default 0) applies when the run's
        M equals its ``lt_m`` (or when ``lt_m`` is absent); other M use rank 0,
        as the ORT library's ``lt_algo_m`` / ``lt_algo_rank`` attributes.
        """
        spec, ep = seg.kernel, seg.epilogues[-1]
        lt = None
        if self.use_lt and spec.param("lt", True):
            try:
                lt = lt_handle()
            except Exception:  # no cuBLASLt: the plain cuBLAS path below
                self.use_lt = False
        if lt is not None:
            code, act_done = lt_split(ep.bias, ep.act, ep.residual)
            fold_residual = ep.residual and ep.act == "none"
            rest = Epilogue(bias=False, act="none" if act_done else ep.act,
                            residual=ep.residual and not fold_residual, norm=ep.norm,
                            norm_shift=ep.norm_shift)
        else:
            code, fold_residual, rest = 0, False, dataclasses.replace(ep, store_pre_norm=False)
        # the GEMM's own result is the pre-norm value when nothing but the norm is left
        gemm_is_pre = (ep.store_pre_norm and not rest.bias and rest.act == "none"
                       and not rest.residual)
        rest = dataclasses.replace(rest, store_pre_norm=ep.store_pre_norm and not gemm_is_pre)
        cfg = norm_family.NormConfig(spec.param("tpr"), spec.param("rows"))
        fn = None
        if not rest.is_identity:
            src = norm_family.render_norm(
                norm_family.NormProblem(4096, seg.dim("n0"), self.dtype, rest), cfg)
            mod, fn = _load(src, self.arch, 0)
            self._modules.append(mod)
        rank, lt_m = int(spec.param("lt_algo", 0) or 0), spec.param("lt_m")
        if lt is not None:  # the [K, N] copy now: never during a graph capture
            name = seg.binding("w0")
            params = getattr(self, "params", {})
            if name in params:
                self._weight_kn(name, params[name])
        return _Loaded(fn, 0, cfg.tpr * cfg.rows,
                       (cfg, lt, code, fold_residual, rest, gemm_is_pre, rank, lt_m), "vendor")

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
        m = batch * seq_len
        ep = seg.epilogues[-1]
        i32, f32 = np.int32, np.float32
        if loaded.kind == "norm":
            n = seg.dim("n")
            x = self._get(values, seg, "x", (m, n))
            out = self._empty((m, n), dtype=self.storage)
            pre = self._empty((m, n), dtype=self.storage) if ep.store_pre_norm else self._dummy
            self._launch_norm(loaded, seg, values, x, out, pre, m, n, stream)
            self._store(values, seg, out, pre)
            return
        k, n = seg.dim("k0"), seg.dim("n0")
        x = self._get(values, seg, "x", (m, k))
        w = self._get(values, seg, "w0", (n, k))
        if loaded.kind == "gemm_gemm":
            cfg, problem, finisher = loaded.config
            n2 = problem.n2
            w1 = self._get(values, seg, "w1", (n2, n))
            out = self._empty((m, n2), dtype=self.storage)
            pre = self._empty((m, n2), dtype=self.storage) if ep.store_pre_norm else self._dummy
            ws = _cupy().zeros((m, n2), dtype=np.float32) if finisher else self._dummy
            args = (x, w, w1, out, self._get(values, seg, "b0", (n,)),
                    self._get(values, seg, "b1", (n2,)),
                    self._get(values, seg, "residual", (m, n2)), ws, i32(m))
            loaded.function((-(-m // cfg.bm), cfg.split, 1), (loaded.threads, 1, 1), args,
                            shared_mem=loaded.smem, stream=stream)
            if finisher is not None:
                self._launch_norm(finisher, seg, values, ws, out, pre, m, n2, stream,
                                  bias_slot="b1")
            self._store(values, seg, out, pre)
            return
        store = seg.kernel.param("store", "row")
        heads, head_dim = self.layer.attention.num_heads, self.layer.attention.head_dim
        if store == "heads":
            if n % (heads * head_dim):
                raise SegmentInputError(f"heads store needs N={n} divisible by H*D",
                                        hint="use store='row'")
            out = self._empty((n // (heads * head_dim), batch, heads, seq_len, head_dim),
                             dtype=self.storage)
        else:
            out = self._empty((m, n), dtype=self.storage)
        pre = self._empty((m, n), dtype=self.storage) if ep.store_pre_norm else self._dummy
        if loaded.kind == "vendor":
            if store != "row":
                raise SegmentInputError("the vendor path stores row-major only",
                                        hint="plan store='row' for cuBLAS segments")
            self._run_vendor(loaded, seg, values, x, w, out, pre, m, n, stream)
            self._store(values, seg, out, pre)
            return
        cfg = loaded.config
        grid_x = 1 if ep.norm != "none" else -(-n // cfg.bn)
        if ep.norm != "none" and cfg.bn < n:
            raise SegmentInputError(f"GEMM+norm tile {cfg.bn} narrower than the row {n}",
                                    hint="choose bn >= out_features")
        args = (x, w, out, self._get(values, seg, "b0", (n,)),
                self._get(values, seg, "residual", (m, n)), self._get(values, seg, "gamma", (n,)),
                self._get(values, seg, "beta", (n,)), pre, i32(m), i32(n), i32(k),
                i32(seq_len), i32(heads), i32(head_dim), f32(seg.epsilon))
        loaded.function((grid_x, -(-m // cfg.bm), 1), (loaded.threads, 1, 1), args,
                        shared_mem=loaded.smem, stream=stream)
        self._store(values, seg, out, pre)

    def _run_vendor(self, loaded, seg, values, x, w, out, pre, m, n, stream) -> None:
        cfg, lt, code, fold_residual, rest, gemm_is_pre, rank, lt_m = loaded.config
        ep = seg.epilogues[-1]
        if rest.is_identity:
            gemm_out = out
        elif gemm_is_pre:
            gemm_out = pre
        else:
            gemm_out = self._empty((m, n), dtype=self.storage)
        if lt is not None:
            ptr = stream.ptr if stream is not None else _cupy().cuda.get_current_stream().ptr
            bias = self._get(values, seg, "b0", (n,)) if ep.bias else None
            residual = self._get(values, seg, "residual", (m, n)) if fold_residual else None
            lt.matmul(x, self._weight_kn(seg.binding("w0"), w), gemm_out, self.dtype, ptr,
                      bias=bias, epilogue=code, residual=residual,
                      algo_rank=rank if lt_m is None or int(lt_m) == m else 0,
                      exact_rank=getattr(self, "lt_exact_rank", False))
        else:
            cublas_gemm(x, w, gemm_out, self.dtype, stream=stream)
        if rest.is_identity:
            return
        args = (gemm_out, self._get(values, seg, "b0", (n,)) if rest.bias else self._dummy,
                self._get(values, seg, "residual", (m, n)) if rest.residual else self._dummy,
                self._get(values, seg, "gamma", (n,)) if rest.norm != "none" else self._dummy,
                self._get(values, seg, "beta", (n,)) if rest.norm_shift and rest.norm != "none"
                else self._dummy, out,
                pre if rest.store_pre_norm else self._dummy,
                np.int32(m), np.int32(n), np.float32(seg.epsilon))
        loaded.function((-(-m // cfg.rows), 1, 1), (loaded.threads, 1, 1), args, stream=stream)

    def _empty(self, shape, dtype):
        cupy = _cupy()
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
        """Run every segment in order; ``attention(segment, values)`` returns its output."""
        for seg in self.plan.segments:
            if seg.family == "attention":
                if attention is None:
                    raise SegmentInputError("the chain has an attention segment",
                                            hint="pass attention=callable(segment, values)")
                values[seg.outputs[0]] = attention(seg, values)
            else:
                self.run_segment(seg, values, batch=batch, seq_len=seq_len, stream=stream)
        return values


def cublas_gemm(x, w_nk, out, dtype: str, *, stream=None) -> None:
    """``out[M, N] = x[M, K] @ w_nk[N, K]ᵀ`` through cublasGemmEx (fp32 accumulation).

    Called through ctypes (:mod:`stofc.runtime.segment_cublas`) so that it can
    be captured in a CUDA graph together with the fused epilogue kernels.
    """
    from stofc.runtime.segment_cublas import handle

    ptr = stream.ptr if stream is not None else _cupy().cuda.get_current_stream().ptr
    handle().gemm(x, w_nk, out, dtype, ptr)


def epilogue_of(seg: Segment) -> Epilogue:
    """The segment's last epilogue (what its output went through)."""
    return seg.epilogues[-1]
