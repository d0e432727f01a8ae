"""Gated FFN projections (segment kind ``gemm_glu``): ``y = act(x Wg + bg) * (x Wu + bu)``.

A ``gemm_glu`` segment is a gated FFN's packed gate/up projection (``w0`` =
``[Wg | Wu]``, ``[K, 2F]``; ``b0`` = ``[bg | bu]`` when the model has biases) with
the gated activation as its epilogue (``epilogues[0]``: its ``bias`` and ``act``:
``silu`` SwiGLU, ``gelu_erf`` / ``gelu_tanh`` GeGLU, ``relu`` ReGLU); the output is
``[tokens, F]``. Two families run it (and ``glu``, :class:`GatedAct`, runs the gated
activation alone when a scheme splits it from its GEMM: ``bias?, gated``):

* ``vendor_glu`` (preference 0, the analytical default, as for plain GEMMs:
  :mod:`stofc.kernels.vendor_gemm`): cuBLASLt computes ``t = x [Wg | Wu] (+ b)``
  (``[M, 2F]``, the bias folded by its epilogue), then the gated-activation kernel
  ``gemm/glu.cu.j2`` writes ``act(t[:, :F]) * t[:, F:]`` in one memory pass (plain
  cuBLAS when cuBLASLt is unavailable: the kernel adds the bias). The ORT library's
  ``GatedGemm`` CUDA twin is this path (``cuda/ort/OPS.md``). Config: ``lt``, the
  kernel's ``tpr`` / ``rows`` and cuBLASLt's heuristic rank ``lt_algo`` (with
  ``lt_m``, as the vendor GEMM family records it).
* ``gemm_glu`` (hand-written): ``gemm/gemm_glu.cu.j2``, the mma.sync GEMM of
  :mod:`stofc.kernels.gemm` whose epilogue forms the product in registers. It reads W
  with the gate and up rows *interleaved* (``[N, K]`` row ``2f`` = gate ``f``, row
  ``2f + 1`` = up ``f``; the bias likewise: :func:`interleave`), so the two columns a
  thread holds are one (gate, up) pair. Config and search space: the GEMM template's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from stofc.codegen import Source, render
from stofc.kernels import gemm as gemm_family
from stofc.kernels.epilogue import Epilogue
from stofc.kernels.gemm import DTYPES, GemmConfig, GemmProblem
from stofc.kernels.reference import gated
from stofc.kernels.registry import (
    KernelFamily,
    KernelInstance,
    ParamValue,
    PlanContext,
    SegmentView,
    register,
)
from stofc.kernels.space import Space, check
from stofc.kernels.spec import KernelSpec
from stofc.kernels.vendor_gemm import LT_ALGO, LT_ALGO_RANKS, LT_M, vendor_tag
from stofc.targets import GpuProfile

SEGMENT = "gemm_glu"
ACT_TEMPLATE = "gemm/glu.cu.j2"
GEMM_TEMPLATE = "gemm/gemm_glu.cu.j2"
VENDOR_TEMPLATE = "vendor/cublas"
VENDOR_FAMILY = "vendor_glu"
VEC = 8  # elements per 16-byte access


def interleave(array: Any) -> Any:
    """``[Wg | Wu]`` rows (``[2F, ...]``, gate first) as gate/up pairs: row ``2f`` = gate
    ``f``, row ``2f + 1`` = up ``f`` (numpy or CuPy; the hand-written template's W and
    bias)."""
    f = array.shape[0] // 2
    return array.reshape(2, f, *array.shape[1:]).swapaxes(0, 1).reshape(array.shape)


# ----------------------------------------------------------------- the gated-activation pass
@dataclass(frozen=True)
class GatedProblem:
    """``act(x[:, :f] + bg) * (x[:, f:] + bu)`` on rows of ``2f`` (``m`` a hint)."""

    m: int
    f: int
    dtype: str
    act: str
    bias: bool


@dataclass(frozen=True)
class GatedConfig:
    """Threads per row (whole warps) and rows per block of the gated-activation kernel."""

    tpr: int
    rows: int


def _gated_constraints(env: dict) -> None:
    check(env["tpr"] * env["rows"] <= 1024, "at most 1024 threads per block")
    check(env["tpr"] * env["rows"] >= 64, "fewer than 2 warps per block under-fills the SM")
    check(env["tpr"] == 32 or env["tpr"] * VEC <= 2 * env["f"],
          "over half the row's threads would have no 16-byte vector to work on")


def gated_space(problem: GatedProblem) -> Space:
    """Threads-per-row and rows-per-block candidates of the gated-activation kernel."""
    return Space(axes=(("tpr", (32, 64, 128, 256, 512)), ("rows", (1, 2, 4, 8))),
                 constraints=(_gated_constraints,), fixed=(("f", problem.f),))


def gated_default(problem: GatedProblem) -> GatedConfig:
    """About four vectors per thread, at least four warps per block."""
    tpr = 32
    while tpr < 512 and problem.f > 4 * VEC * tpr:
        tpr *= 2
    return GatedConfig(tpr, max(1, 128 // tpr))


def gated_kernel_name(problem: GatedProblem, config: GatedConfig) -> str:
    return (f"stofc_glu_{problem.dtype}_{problem.act}{'_b' if problem.bias else ''}"
            f"_f{problem.f}_t{config.tpr}x{config.rows}")


def gated_kernel(problem: GatedProblem, config: GatedConfig, role: str = "main"
                 ) -> KernelInstance:
    """The gated-activation kernel as the ``vendor_glu`` family's instance."""
    return KernelInstance(VENDOR_FAMILY, problem, config, gated_kernel_name(problem, config),
                          role=role)


def render_gated(problem: GatedProblem, config: GatedConfig) -> Source:
    """The CUDA source of the gated-activation kernel (one ``extern "C"`` entry:
    ``(x, bias, out, M, F)``, grid ``ceil(M / rows)``, ``tpr * rows`` threads)."""
    name = gated_kernel_name(problem, config)
    return render(ACT_TEMPLATE, name, (name,), NAME=name, DTYPE=DTYPES[problem.dtype],
                  TPR=config.tpr, ROWS=config.rows, HAS_BIAS=int(problem.bias),
                  ACT=Epilogue(act=problem.act).template_values()["ACT"])


# ----------------------------------------------------------------- the segment kind
@dataclass(frozen=True)
class GluProblem:
    """A ``gemm_glu`` segment: ``x [m, k] @ [Wg | Wu] [k, 2f]`` then the gated epilogue."""

    m: int
    f: int
    k: int
    dtype: str
    epilogue: Epilogue

    def gated(self, *, bias: bool) -> GatedProblem:
        """The gated-activation pass of this problem (``bias``: whether it adds it)."""
        return GatedProblem(self.m, self.f, self.dtype, self.epilogue.act, bias)

    def as_gemm(self) -> GemmProblem:
        """The GEMM of width ``2f`` the hand-written template's space is declared on."""
        return GemmProblem(self.m, 2 * self.f, self.k, self.dtype,
                           Epilogue(bias=self.epilogue.bias))


class GluSegmentFamily(KernelFamily[GluProblem, Any]):
    """What both families of ``gemm_glu`` segments share: problem, tuning key, widths and
    the float64 reference."""

    segments = (SEGMENT,)

    def problem(self, seg: SegmentView, ctx: PlanContext) -> GluProblem:
        return GluProblem(ctx.tokens, seg.dim("n0") // 2, seg.dim("k0"), ctx.dtype,
                          seg.epilogues[0])

    def tuning_key(self, problem: GluProblem, profile: GpuProfile,
                   identities: tuple[Any, ...]) -> tuple[Any, ...]:
        p = problem
        return ("tokens", p.m, 2 * p.f, p.k, p.dtype, "glu", p.epilogue.tag, *identities,
                profile.arch)

    def widths(self, seg: SegmentView) -> tuple[int, int]:
        return seg.dim("k0"), seg.dim("n0") // 2

    def reference(self, seg: SegmentView, act: Any, param: Any, kn: Any,
                  extra: dict[str, Any]) -> tuple[np.ndarray, None]:
        y = act("x") @ kn("w0")
        ep = seg.epilogues[0]
        if ep.bias:
            y = y + param("b0")
        return gated(y, ep.act), None


@dataclass(frozen=True)
class VendorGluConfig:
    """cuBLASLt (``lt``) or plain cuBLAS, the gated kernel's shape, the heuristic rank."""

    lt: bool
    tpr: int
    rows: int
    lt_algo: int = 0

    @property
    def gated(self) -> GatedConfig:
        return GatedConfig(self.tpr, self.rows)



@register
class VendorGlu(GluSegmentFamily):
    """``gemm_glu`` on cuBLAS(Lt) plus the gated-activation kernel (module doc)."""

    name = VENDOR_FAMILY
    templates = (VENDOR_TEMPLATE,)
    config_type = VendorGluConfig
    preference = 0
    space_order = 10
    tuner_tag = (("impl", "cublas"),)
    vendor = True

    def candidates(self, problem: GluProblem, profile: GpuProfile
                   ) -> tuple[list[VendorGluConfig], dict[str, int]]:
        """Per library: the gated kernel's space, cuBLASLt's crossed with the ranks."""
        configs: list[VendorGluConfig] = []
        reasons: dict[str, int] = {}
        for lt in (True, False):
            space = gated_space(problem.gated(bias=problem.epilogue.bias and not lt))
            for key, count in space.explain().items():
                if key != "valid":
                    key = f"cublas{'Lt' if lt else ''} gated kernel: {key}"
                    reasons[key] = reasons.get(key, 0) + count
            ranks = range(LT_ALGO_RANKS) if lt else (0,)
            configs += [VendorGluConfig(lt, c["tpr"], c["rows"], r) for c in space.configs()
                        for r in ranks]
        return configs, reasons

    def space(self, problem: GluProblem, profile: GpuProfile) -> Any:
        raise NotImplementedError("the vendor path's space is two libraries' (see candidates)")

    def default(self, problem: GluProblem, profile: GpuProfile) -> VendorGluConfig:
        cfg = gated_default(problem.gated(bias=False))
        return VendorGluConfig(True, cfg.tpr, cfg.rows)

    def spec(self, problem: GluProblem, config: VendorGluConfig) -> KernelSpec:
        params: tuple[tuple[str, Any], ...] = (
            ("dtype", problem.dtype), ("lt", config.lt), ("tpr", config.tpr),
            ("rows", config.rows))
        rank = config.lt_algo if config.lt else 0
        if rank:
            params = (*params, (LT_ALGO, rank), (LT_M, int(problem.m)))
        return KernelSpec(SEGMENT, VENDOR_TEMPLATE, params)

    def config_of(self, spec: KernelSpec, problem: Any) -> VendorGluConfig:
        """The spec's config; its rank applies only at the M it was tuned at (``lt_m``)."""
        lt = bool(spec.param("lt", True))
        rank = int(spec.param(LT_ALGO, 0) or 0) if lt else 0
        lt_m = spec.param(LT_M)
        if problem is not None and lt_m is not None and int(lt_m) != problem.m:
            rank = 0
        return VendorGluConfig(lt, int(spec.param("tpr")), int(spec.param("rows")), rank)

    def params(self, config: VendorGluConfig) -> dict[str, ParamValue]:
        out: dict[str, ParamValue] = {"impl": "cublas", "lt": config.lt, "tpr": config.tpr,
                                      "rows": config.rows}
        if config.lt:
            out[LT_ALGO] = config.lt_algo
        return out

    def from_params(self, params: Any) -> VendorGluConfig:
        return VendorGluConfig(bool(params["lt"]), int(params["tpr"]), int(params["rows"]),
                               int(params.get(LT_ALGO, 0) or 0))

    def twin_epilogue_config(self, spec: KernelSpec) -> GatedConfig | None:
        if spec.param("tpr") and spec.param("rows"):
            return GatedConfig(int(spec.param("tpr")), int(spec.param("rows")))
        return None

    def twin_lt_rank(self, spec: KernelSpec) -> tuple[int, int] | None:
        if not spec.param(LT_ALGO) or not spec.param(LT_M):
            return None
        return int(spec.param(LT_M)), int(spec.param(LT_ALGO))

    def identity(self, problem: GluProblem) -> tuple[Any, ...]:
        return (vendor_tag(),)

    def kernels(self, problem: GluProblem, config: VendorGluConfig
                ) -> tuple[KernelInstance, ...]:
        """The gated-activation kernel the run launches after the GEMM (with the bias
        when plain cuBLAS leaves it; cuBLASLt folds it, as the CUDA twin does)."""
        gp = problem.gated(bias=problem.epilogue.bias and not config.lt)
        return (gated_kernel(gp, config.gated),)

    def render(self, kernel: KernelInstance) -> Source:
        return render_gated(kernel.problem, kernel.config)


def gemm_glu_kernel_name(problem: GluProblem, config: GemmConfig) -> str:
    c = config
    return (f"stofc_gemm_glu_{problem.dtype}_{problem.epilogue.tag.replace('-', '_')}"
            f"_{c.bm}x{c.bn}x{c.bk}_w{c.warps_m}x{c.warps_n}_s{c.stages}")


def render_gemm_glu(problem: GluProblem, config: GemmConfig) -> Source:
    """The CUDA source of the hand-written gated GEMM (``(A, W, C, bias, M, N, K)``, W and
    bias interleaved, N = 2F; grid ``(ceil(N / bn), ceil(M / bm))``)."""
    name = gemm_glu_kernel_name(problem, config)
    values = problem.epilogue.template_values()
    return render(GEMM_TEMPLATE, name, (name,), NAME=name, DTYPE=DTYPES[problem.dtype],
                  BM=config.bm, BN=config.bn, BK=config.bk, WARPS_M=config.warps_m,
                  WARPS_N=config.warps_n, STAGES=config.stages,
                  HAS_BIAS=values["HAS_BIAS"], ACT=values["ACT"])


@register
class GemmGlu(GluSegmentFamily):
    """``gemm_glu`` on the hand-written template (interleaved gate/up rows, module doc)."""

    name = "gemm_glu"
    templates = (GEMM_TEMPLATE,)
    config_type = GemmConfig
    preference = 10
    space_order = 0
    tuner_tag = (("impl", "mma"),)

    def space(self, problem: GluProblem, profile: GpuProfile) -> Space:
        return gemm_family.space(problem.as_gemm(), profile)

    def candidates(self, problem: GluProblem, profile: GpuProfile
                   ) -> tuple[list[GemmConfig], dict[str, int]]:
        configs, reasons = super().candidates(problem, profile)
        return configs, {f"mma: {k}": v for k, v in reasons.items()}

    def default(self, problem: GluProblem, profile: GpuProfile) -> GemmConfig:
        return gemm_family.default_config(problem.as_gemm(), profile)

    def spec(self, problem: GluProblem, config: GemmConfig) -> KernelSpec:
        return KernelSpec(SEGMENT, GEMM_TEMPLATE, (("dtype", problem.dtype),
                                                   *config.as_params()))

    def config_of(self, spec: KernelSpec, problem: GluProblem | None) -> GemmConfig:
        return GemmConfig(*(int(spec.param(k)) for k in ("bm", "bn", "bk", "warps_m",
                                                          "warps_n", "stages")))

    def params(self, config: GemmConfig) -> dict[str, ParamValue]:
        return {**dict(self.tuner_tag), **asdict(config)}

    def kernels(self, problem: GluProblem, config: GemmConfig) -> tuple[KernelInstance, ...]:
        return (KernelInstance(self.name, problem, config,
                               gemm_glu_kernel_name(problem, config)),)

    def render(self, kernel: KernelInstance) -> Source:
        return render_gemm_glu(kernel.problem, kernel.config)


@register
class GatedAct(KernelFamily[GatedProblem, GatedConfig]):
    """``glu`` segments (bias?, gated: the gated activation without its GEMM, a split
    scheme's) in one memory pass: the gated-activation kernel on ``[tokens, 2F]``."""

    name = "glu"
    segments = ("glu",)
    templates = (ACT_TEMPLATE,)
    config_type = GatedConfig
    preference = 10

    def problem(self, seg: SegmentView, ctx: PlanContext) -> GatedProblem:
        ep = seg.epilogues[0]
        return GatedProblem(ctx.tokens, seg.dim("n") // 2, ctx.dtype, ep.act, ep.bias)

    def space(self, problem: GatedProblem, profile: GpuProfile) -> Space:
        return gated_space(problem)

    def default(self, problem: GatedProblem, profile: GpuProfile) -> GatedConfig:
        return gated_default(problem)

    def spec(self, problem: GatedProblem, config: GatedConfig) -> KernelSpec:
        return KernelSpec("glu", ACT_TEMPLATE, (("dtype", problem.dtype), ("f", problem.f),
                                                ("tpr", config.tpr), ("rows", config.rows)))

    def config_of(self, spec: KernelSpec, problem: GatedProblem | None) -> GatedConfig:
        return GatedConfig(int(spec.param("tpr")), int(spec.param("rows")))

    def tuning_key(self, problem: GatedProblem, profile: GpuProfile,
                   identities: tuple[Any, ...]) -> tuple[Any, ...]:
        p = problem
        return ("tokens", p.m, 2 * p.f, p.dtype, "glu", p.act, p.bias, *identities,
                profile.arch)

    def widths(self, seg: SegmentView) -> tuple[int, int]:
        return seg.dim("n"), seg.dim("n") // 2

    def reference(self, seg: SegmentView, act: Any, param: Any, kn: Any,
                  extra: dict[str, Any]) -> tuple[np.ndarray, None]:
        ep = seg.epilogues[0]
        x = act("x")
        return gated(x + param("bias") if ep.bias else x, ep.act), None

    def kernels(self, problem: GatedProblem, config: GatedConfig
                ) -> tuple[KernelInstance, ...]:
        return (KernelInstance(self.name, problem, config, gated_kernel_name(problem, config)),)

    def render(self, kernel: KernelInstance) -> Source:
        return render_gated(kernel.problem, kernel.config)


__all__ = ["GatedConfig", "GatedProblem", "GluProblem", "VendorGluConfig", "gated_default",
           "gated_kernel", "gated_space", "interleave", "render_gated", "render_gemm_glu"]
