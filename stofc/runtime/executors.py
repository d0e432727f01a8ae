"""How the CuPy segment runner compiles and launches each kernel family's segments.

One :class:`SegmentExecutor` per family (or group of families sharing a kernel),
registered with :func:`executes` under the family names it serves; the runner
(:class:`stofc.runtime.segments.SegmentRunner`) finds it through the family that
wrote the segment's KernelSpec (:func:`stofc.kernels.catalog.family_of`). A second
executor for a family name is an error at import time. The kernels themselves
(problem, config, sources) are the family's; an executor only renders them
through it, loads them and packs their arguments.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from stofc.errors import PlanError, RegistryError, StofcError
from stofc.kernels import catalog
from stofc.kernels import gemm as gemm_family
from stofc.kernels import gemm_gemm as gg_family
from stofc.kernels import glu as glu_family
from stofc.kernels import norm as norm_family
from stofc.kernels.registry import KernelInstance, PlanContext
from stofc.kernels.vendor_gemm import LT_BIAS, LT_DEFAULT, lt_split, vendor_rest
from stofc.plan.plan import Segment
from stofc.runtime.module import _cupy

if TYPE_CHECKING:
    from stofc.runtime.segments import SegmentRunner

TOKENS_HINT = 4096   # GEMM/norm problems carry M only as a hint; the kernels take M at run time


@dataclass
class Loaded:
    """One segment's compiled kernel(s) and what its launches need."""

    function: Any
    smem: int
    threads: int
    config: Any
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class SegmentExecutor(ABC):
    """Compiles (through the runner's loader) and launches one family's segments."""

    families: ClassVar[tuple[str, ...]]

    @abstractmethod
    def compile(self, runner: SegmentRunner, seg: Segment) -> Loaded:
        """Render, compile and load the segment's kernels."""

    @abstractmethod
    def run(self, runner: SegmentRunner, loaded: Loaded, seg: Segment, values: dict[str, Any],
            *, batch: int, seq_len: int, stream: Any) -> None:
        """Launch the segment on the inputs in ``values``; store its outputs there."""


_EXECUTORS: dict[str, SegmentExecutor] = {}
E = TypeVar("E", bound=type)


def executes(cls: E) -> E:
    """Class decorator: register the executor for its ``families`` (loud on duplicates)."""
    executor = cls()
    for name in executor.families:
        if name in _EXECUTORS:
            raise RegistryError(f"kernel family {name!r} has two runtime executors "
                                f"({type(_EXECUTORS[name]).__name__} and {cls.__name__})")
        _EXECUTORS[name] = executor
    return cls


def executor_for(seg: Segment) -> SegmentExecutor:
    """The executor of the family that wrote ``seg``'s kernel spec."""
    fam = catalog.family_of(seg.kernel)
    try:
        return _EXECUTORS[fam.name]
    except KeyError:
        raise StofcError(f"segment {seg.ordinal} ({seg.family}) runs on kernel family "
                         f"{fam.name!r}, which the CuPy runner cannot launch",
                         hint="attention segments run through the attention runner") from None


def runs_here(seg: Segment) -> bool:
    """Whether the CuPy segment runner launches ``seg`` (attention runs elsewhere; a plan
    built without masks has no attention kernel at all)."""
    try:
        return catalog.family_of(seg.kernel).name in _EXECUTORS
    except PlanError:
        return False


def _problem(seg: Segment, dtype: str) -> tuple[Any, Any, Any]:
    """(family, problem, config) of a segment's spec, at the runner's M hint."""
    fam = catalog.family_of(seg.kernel)
    ctx = PlanContext(tokens=TOKENS_HINT, dtype=dtype, profile=None,
                      store=seg.kernel.param("store", "row"))
    problem = fam.problem(seg, ctx)
    return fam, problem, fam.config_of(seg.kernel, problem)


def _render(kernel: KernelInstance) -> Any:
    return catalog.family(kernel.family).render(kernel)


@executes
class GemmExecutor(SegmentExecutor):
    """The GEMM template with its epilogue (norm epilogues span the row)."""

    families = ("gemm", "gemm_norm")

    def compile(self, runner: SegmentRunner, seg: Segment) -> Loaded:
        fam, problem, cfg = _problem(seg, runner.dtype)
        smem = cfg.smem_bytes(runner.dtype)
        fn = runner.load(_render(fam.kernels(problem, cfg)[0]), smem)
        return Loaded(fn, smem, cfg.threads, cfg)

    def run(self, runner: SegmentRunner, loaded: Loaded, seg: Segment, values: dict[str, Any],
            *, batch: int, seq_len: int, stream: Any) -> None:
        m, ep = batch * seq_len, seg.epilogues[-1]
        k, n = seg.dim("k0"), seg.dim("n0")
        x, w = runner._get(values, seg, "x", (m, k)), runner._get(values, seg, "w0", (n, k))
        out, pre = runner.gemm_outputs(seg, batch, seq_len, n)
        cfg: gemm_family.GemmConfig = loaded.config
        grid_x = 1 if ep.norm != "none" else -(-n // cfg.bn)
        if ep.norm != "none" and cfg.bn < n:
            raise StofcError(f"GEMM+norm tile {cfg.bn} narrower than the row {n}",
                             hint="choose bn >= out_features")
        heads, head_dim = runner.layer.attention.num_heads, runner.layer.attention.head_dim
        i32, f32 = np.int32, np.float32
        args = (x, w, out, runner._get(values, seg, "b0", (n,)),
                runner._get(values, seg, "residual", (m, n)),
                runner._get(values, seg, "gamma", (n,)), runner._get(values, seg, "beta", (n,)),
                pre, i32(m), i32(n), i32(k), i32(seq_len), i32(heads), i32(head_dim),
                f32(seg.epsilon))
        loaded.function((grid_x, -(-m // cfg.bm), 1), (loaded.threads, 1, 1), args,
                        shared_mem=loaded.smem, stream=stream)
        runner._store(values, seg, out, pre)


@executes
class NormExecutor(SegmentExecutor):
    """The Add+Norm template on a memory-bound segment."""

    families = (norm_family.FAMILY,)

    def compile(self, runner: SegmentRunner, seg: Segment) -> Loaded:
        fam, problem, cfg = _problem(seg, runner.dtype)
        fn = runner.load(_render(fam.kernels(problem, cfg)[0]), 0)
        return Loaded(fn, 0, cfg.tpr * cfg.rows, cfg)

    def run(self, runner: SegmentRunner, loaded: Loaded, seg: Segment, values: dict[str, Any],
            *, batch: int, seq_len: int, stream: Any) -> None:
        m, n, ep = batch * seq_len, seg.dim("n"), seg.epilogues[-1]
        x = runner._get(values, seg, "x", (m, n))
        out = runner._empty((m, n))
        pre = runner._empty((m, n)) if ep.store_pre_norm else runner._dummy
        runner._launch_norm(loaded, seg, values, x, out, pre, m, n, stream)
        runner._store(values, seg, out, pre)


@executes
class GemmGemmExecutor(SegmentExecutor):
    """GEMM+GEMM, and its fp32 Add+Norm finisher when the partial sums use the workspace."""

    families = ("gemm_gemm",)

    def compile(self, runner: SegmentRunner, seg: Segment) -> Loaded:
        fam, problem, cfg = _problem(seg, runner.dtype)
        kernels = fam.kernels(problem, cfg)
        smem = cfg.smem_bytes(problem)
        fn = runner.load(_render(kernels[0]), smem)
        finisher = None
        if len(kernels) > 1:
            ncfg = kernels[1].config
            finisher = Loaded(runner.load(_render(kernels[1]), 0), 0, ncfg.tpr * ncfg.rows, ncfg)
        return Loaded(fn, smem, cfg.warps * 32, cfg, {"problem": problem, "finisher": finisher})

    def run(self, runner: SegmentRunner, loaded: Loaded, seg: Segment, values: dict[str, Any],
            *, batch: int, seq_len: int, stream: Any) -> None:
        m, ep = batch * seq_len, seg.epilogues[-1]
        k, n = seg.dim("k0"), seg.dim("n0")
        cfg: gg_family.GemmGemmConfig = loaded.config
        problem, finisher = loaded.extra["problem"], loaded.extra["finisher"]
        n2 = problem.n2
        x, w = runner._get(values, seg, "x", (m, k)), runner._get(values, seg, "w0", (n, k))
        w1 = runner._get(values, seg, "w1", (n2, n))
        out = runner._empty((m, n2))
        pre = runner._empty((m, n2)) if ep.store_pre_norm else runner._dummy
        ws = _cupy().zeros((m, n2), dtype=np.float32) if finisher else runner._dummy
        args = (x, w, w1, out, runner._get(values, seg, "b0", (n,)),
                runner._get(values, seg, "b1", (n2,)),
                runner._get(values, seg, "residual", (m, n2)), ws, np.int32(m))
        loaded.function((-(-m // cfg.bm), cfg.split, 1), (loaded.threads, 1, 1), args,
                        shared_mem=loaded.smem, stream=stream)
        if finisher is not None:
            runner._launch_norm(finisher, seg, values, ws, out, pre, m, n2, stream,
                                bias_slot="b1")
        runner._store(values, seg, out, pre)


@executes
class VendorExecutor(SegmentExecutor):
    """cuBLASLt with what its epilogue can fold (bias, ReLU/tanh GELU, residual as C), then
    the Add+Norm template for the rest; cuBLAS + the whole epilogue if Lt is unavailable.

    The spec's ``lt_algo`` (heuristic rank, default 0) applies when the run's
    M equals its ``lt_m`` (or when ``lt_m`` is absent); other M use rank 0,
    as the ORT library's ``lt_algo_m`` / ``lt_algo_rank`` attributes.
    """

    families = ("vendor_gemm",)

    def compile(self, runner: SegmentRunner, seg: Segment) -> Loaded:
        spec, ep = seg.kernel, seg.epilogues[-1]
        lt = runner.lt() if runner.use_lt and spec.param("lt", True) else None
        code, _ = lt_split(ep.bias, ep.act, ep.residual) if lt is not None else (0, False)
        rest = vendor_rest(ep, lt is not None)
        fold_residual = lt is not None and ep.residual and ep.act == "none"
        # the GEMM's own result is the pre-norm value when nothing but the norm is left
        gemm_is_pre = (ep.store_pre_norm and not rest.bias and rest.act == "none"
                       and not rest.residual)
        rest = dataclasses.replace(rest, store_pre_norm=ep.store_pre_norm and not gemm_is_pre)
        cfg = norm_family.NormConfig(spec.param("tpr"), spec.param("rows"))
        fn = None
        if not rest.is_identity:
            nproblem = norm_family.NormProblem(TOKENS_HINT, seg.dim("n0"), runner.dtype, rest)
            fn = runner.load(norm_family.render_norm(nproblem, cfg), 0)
        rank, lt_m = int(spec.param("lt_algo", 0) or 0), spec.param("lt_m")
        if lt is not None:  # the [K, N] copy now: never during a graph capture
            name = seg.binding("w0")
            params = getattr(runner, "params", {})
            if name in params:
                runner._weight_kn(name, params[name])
        return Loaded(fn, 0, cfg.tpr * cfg.rows, cfg,
                      {"lt": lt, "code": code, "fold_residual": fold_residual, "rest": rest,
                       "gemm_is_pre": gemm_is_pre, "rank": rank, "lt_m": lt_m})

    def run(self, runner: SegmentRunner, loaded: Loaded, seg: Segment, values: dict[str, Any],
            *, batch: int, seq_len: int, stream: Any) -> None:
        m, n, k = batch * seq_len, seg.dim("n0"), seg.dim("k0")
        x, w = runner._get(values, seg, "x", (m, k)), runner._get(values, seg, "w0", (n, k))
        if seg.kernel.param("store", "row") != "row":
            raise StofcError("the vendor path stores row-major only",
                             hint="plan store='row' for cuBLAS segments")
        out, pre = runner.gemm_outputs(seg, batch, seq_len, n)
        e, ep = loaded.extra, seg.epilogues[-1]
        rest = e["rest"]
        if rest.is_identity:
            gemm_out = out
        elif e["gemm_is_pre"]:
            gemm_out = pre
        else:
            gemm_out = runner._empty((m, n))
        if e["lt"] is not None:
            ptr = stream.ptr if stream is not None else _cupy().cuda.get_current_stream().ptr
            bias = runner._get(values, seg, "b0", (n,)) if ep.bias else None
            residual = runner._get(values, seg, "residual", (m, n)) if e["fold_residual"] else None
            e["lt"].matmul(x, runner._weight_kn(seg.binding("w0"), w), gemm_out, runner.dtype,
                           ptr, bias=bias, epilogue=e["code"], residual=residual,
                           algo_rank=e["rank"] if e["lt_m"] is None or int(e["lt_m"]) == m else 0,
                           exact_rank=getattr(runner, "lt_exact_rank", False))
        else:
            runner.cublas_gemm(x, w, gemm_out, stream=stream)
        if not rest.is_identity:
            d = runner._dummy
            args = (gemm_out, runner._get(values, seg, "b0", (n,)) if rest.bias else d,
                    runner._get(values, seg, "residual", (m, n)) if rest.residual else d,
                    runner._get(values, seg, "gamma", (n,)) if rest.norm != "none" else d,
                    runner._get(values, seg, "beta", (n,)) if rest.norm_shift
                    and rest.norm != "none" else d, out,
                    pre if rest.store_pre_norm else d,
                    np.int32(m), np.int32(n), np.float32(seg.epsilon))
            loaded.function((-(-m // loaded.config.rows), 1, 1), (loaded.threads, 1, 1), args,
                            stream=stream)
        runner._store(values, seg, out, pre)



@executes
class VendorGluExecutor(SegmentExecutor):
    """A gated FFN's projection: cuBLASLt ``x @ [Wg | Wu]`` (its epilogue adds the bias),
    then the gated-activation kernel; plain cuBLAS + the kernel adding the bias without Lt
    (:mod:`stofc.kernels.glu`; the ORT library's GatedGemm runs the Lt path)."""

    families = (glu_family.VENDOR_FAMILY,)

    def compile(self, runner: SegmentRunner, seg: Segment) -> Loaded:
        _, problem, cfg = _problem(seg, runner.dtype)
        lt = runner.lt() if runner.use_lt and cfg.lt else None
        gated = problem.gated(bias=problem.epilogue.bias and lt is None)
        fn = runner.load(glu_family.render_gated(gated, cfg.gated), 0)
        if lt is not None:  # the [K, N] copy now: never during a graph capture
            name = seg.binding("w0")
            params = getattr(runner, "params", {})
            if name in params:
                runner._weight_kn(name, params[name])
        return Loaded(fn, 0, cfg.tpr * cfg.rows, cfg,
                      {"lt": lt, "gated": gated, "rank": cfg.lt_algo,
                       "lt_m": seg.kernel.param("lt_m")})

    def run(self, runner: SegmentRunner, loaded: Loaded, seg: Segment, values: dict[str, Any],
            *, batch: int, seq_len: int, stream: Any) -> None:
        m, n, k = batch * seq_len, seg.dim("n0"), seg.dim("k0")
        f, e = n // 2, loaded.extra
        x, w = runner._get(values, seg, "x", (m, k)), runner._get(values, seg, "w0", (n, k))
        bias = runner._get(values, seg, "b0", (n,)) if seg.epilogues[0].bias else None
        t, out = runner._empty((m, n)), runner._empty((m, f))
        if e["lt"] is not None:
            ptr = stream.ptr if stream is not None else _cupy().cuda.get_current_stream().ptr
            e["lt"].matmul(x, runner._weight_kn(seg.binding("w0"), w), t, runner.dtype, ptr,
                           bias=bias, epilogue=LT_BIAS if bias is not None else LT_DEFAULT,
                           algo_rank=e["rank"] if e["lt_m"] is None or int(e["lt_m"]) == m
                           else 0, exact_rank=getattr(runner, "lt_exact_rank", False))
        else:
            runner.cublas_gemm(x, w, t, stream=stream)
        args = (t, bias if e["gated"].bias else runner._dummy, out, np.int32(m), np.int32(f))
        loaded.function((-(-m // loaded.config.rows), 1, 1), (loaded.threads, 1, 1), args,
                        stream=stream)
        runner._store(values, seg, out, None)


@executes
class GemmGluExecutor(SegmentExecutor):
    """A gated FFN's projection on the hand-written template: W and the bias with the gate
    and up rows interleaved (:func:`stofc.kernels.glu.interleave`, made once)."""

    families = ("gemm_glu",)

    def compile(self, runner: SegmentRunner, seg: Segment) -> Loaded:
        fam, problem, cfg = _problem(seg, runner.dtype)
        smem = cfg.smem_bytes(runner.dtype)
        fn = runner.load(_render(fam.kernels(problem, cfg)[0]), smem)
        params = getattr(runner, "params", {})
        names = {slot: seg.binding(slot) for slot in ("w0", "b0")}
        pairs = {slot: glu_family.interleave(params[name]) for slot, name in names.items()
                 if name is not None and name in params}
        return Loaded(fn, smem, cfg.threads, cfg, {"pairs": pairs})

    def run(self, runner: SegmentRunner, loaded: Loaded, seg: Segment, values: dict[str, Any],
            *, batch: int, seq_len: int, stream: Any) -> None:
        m, n, k = batch * seq_len, seg.dim("n0"), seg.dim("k0")
        pairs, cfg = loaded.extra["pairs"], loaded.config
        x = runner._get(values, seg, "x", (m, k))
        runner._get(values, seg, "w0", (n, k))         # checks the weight's shape
        bias = pairs.get("b0", runner._dummy) if seg.epilogues[0].bias else runner._dummy
        out = runner._empty((m, n // 2))
        args = (x, pairs["w0"], out, bias, np.int32(m), np.int32(n), np.int32(k))
        loaded.function((-(-n // cfg.bn), -(-m // cfg.bm), 1), (loaded.threads, 1, 1), args,
                        shared_mem=loaded.smem, stream=stream)
        runner._store(values, seg, out, None)
