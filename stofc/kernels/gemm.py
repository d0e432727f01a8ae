"""GEMM with a fused epilogue (families ``gemm`` and ``gemm_norm``): template ``gemm/gemm.cu.j2``.

``C = epilogue(A[M, K] @ W[N, K]ᵀ)``: A row-major activations, W the weight
pre-transposed to ``[N, K]`` (K contiguous; the runner does this once), mma.sync
m16n8k16 with fp32 accumulation and a cp.async multistage pipeline. The
epilogue (:class:`~stofc.kernels.epilogue.Epilogue`) runs on the accumulators;
with a norm the block spans the full row (``gemm_norm``). ``store`` picks the
output layout: ``row`` ([M, N], which for a packed QKV projection *is*
[B, S, 3, H, D]) or ``heads`` ([G, B, H, S, D], G = N / (H*D): Q/K/V split
per head for the attention kernel, no separate transpose).

Two registered families share this template: :class:`Gemm` runs ``gemm`` segments
(no norm) and :mod:`stofc.kernels.gemm_norm` the ``gemm_norm`` ones (the tile spans
the row). :class:`GemmSegmentFamily` is what every family of those two segment kinds
shares: the problem a segment poses, the tuning key and the float64 reference.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np

from stofc.codegen import Source, render
from stofc.kernels.epilogue import Epilogue
from stofc.kernels.reference import apply_epilogue
from stofc.kernels.registry import (
    KernelFamily,
    KernelInstance,
    PlanContext,
    SegmentView,
    register,
)
from stofc.kernels.space import Space, check
from stofc.kernels.spec import KernelSpec
from stofc.targets import GpuProfile

TEMPLATE = "gemm/gemm.cu.j2"
DTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
STORES = ("row", "heads")


@dataclass(frozen=True)
class GemmProblem:
    """What one GEMM segment computes: sizes (M a hint: any M runs), dtype, epilogue."""

    m: int
    n: int
    k: int
    dtype: str
    epilogue: Epilogue
    store: str = "row"

    @property
    def segment(self) -> str:
        """The plan segment kind: ``gemm_norm`` when the epilogue ends in a norm."""
        return "gemm_norm" if self.epilogue.norm != "none" else "gemm"


@dataclass(frozen=True)
class GemmConfig:
    """Tunable parameters of the template."""

    bm: int
    bn: int
    bk: int
    warps_m: int
    warps_n: int
    stages: int

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    def smem_bytes(self, dtype: str) -> int:
        """Dynamic shared memory: the pipeline (reused for the norm's row sums)."""
        elem = 2
        pipe = self.stages * (self.bm + self.bn) * (self.bk + 8) * elem
        return max(pipe, 2 * self.warps_n * self.bm * 4)

    def as_params(self) -> tuple[tuple[str, int], ...]:
        return tuple(asdict(self).items())


def _constraints(env: dict) -> None:
    wm, wn = env["bm"] // env["warps_m"], env["bn"] // env["warps_n"]
    check(env["bm"] % env["warps_m"] == 0 and wm % 16 == 0,
          "each warp's rows must be a multiple of the 16-row MMA tile")
    check(env["bn"] % env["warps_n"] == 0 and wn % 16 == 0,
          "each warp's columns must be a multiple of 16 (two 8-wide MMA tiles per ldmatrix.x4)")
    check(env["warps_m"] * env["warps_n"] <= 16, "at most 16 warps (512 threads) per block")
    acc = (wm // 16) * (wn // 8) * 4
    check(acc <= 128, "more than 128 fp32 accumulators per thread spill registers")
    smem = GemmConfig(env["bm"], env["bn"], env["bk"], env["warps_m"], env["warps_n"],
                      env["stages"]).smem_bytes(env["dtype"])
    check(smem <= env["smem_per_block"], "the pipeline exceeds the shared memory of one block")
    if env["norm"] != "none":
        check(env["bn"] >= env["n"], "a norm epilogue needs the tile to span the full row (BN >= N)")
        check(env["bn"] - env["n"] < 16 * env["warps_n"],
              "the full-row tile wastes more than one MMA column group per warp")
    else:
        check(env["bn"] <= 256, "without a norm, tiles wider than 256 only lose parallelism")
        check(env["k"] >= env["bk"] * (env["stages"] - 1) or env["stages"] == 2,
              "more pipeline stages than K tiles")


def space(problem: GemmProblem, profile: GpuProfile) -> Space:
    """Tile/warp/stage candidates with the constraints above."""
    if problem.epilogue.norm != "none":
        bns = tuple(sorted({_round_up(problem.n, 16 * w) for w in (2, 4, 8)}))
        bms, warps_n = (16, 32, 64), (2, 4, 8)
    else:
        bns, bms, warps_n = (64, 128, 256), (32, 64, 128), (1, 2, 4)
    return Space(
        axes=(("bm", bms), ("bn", bns), ("bk", (32, 64)), ("warps_m", (1, 2, 4)),
              ("warps_n", warps_n), ("stages", (2, 3, 4))),
        constraints=(_constraints,),
        fixed=(("n", problem.n), ("k", problem.k), ("dtype", problem.dtype),
               ("norm", problem.epilogue.norm), ("smem_per_block", profile.smem_per_block)),
    )


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def default_config(problem: GemmProblem, profile: GpuProfile) -> GemmConfig:
    """An analytical choice: the largest tile that still gives one wave of blocks."""
    stages = 4 if profile.smem_per_block >= 200 * 1024 else 3
    if problem.epilogue.norm != "none":
        warps_n = 8 if problem.n > 512 else 4
        bn = _round_up(problem.n, 16 * warps_n)
        bm, warps_m = (32, 2) if problem.m >= 64 * profile.sm_count else (16, 1)
        if warps_m * warps_n > 8:
            warps_n = 4
            bn = _round_up(problem.n, 16 * warps_n)
        cfg = GemmConfig(bm, bn, 32, warps_m, warps_n, stages)
        while cfg.smem_bytes(problem.dtype) > profile.smem_per_block and cfg.stages > 2:
            cfg = GemmConfig(bm, bn, 32, warps_m, warps_n, cfg.stages - 1)
        return cfg
    for bm, bn, wm, wn in ((128, 128, 2, 4), (128, 64, 2, 2), (64, 128, 2, 2), (64, 64, 2, 2),
                           (32, 64, 1, 2)):
        blocks = -(-problem.m // bm) * -(-problem.n // bn)
        if blocks >= profile.sm_count:
            return GemmConfig(bm, bn, 32, wm, wn, stages)
    return GemmConfig(32, 64, 32, 1, 2, stages)


def kernel_name(problem: GemmProblem, config: GemmConfig) -> str:
    c = config
    return (f"stofc_gemm_{problem.dtype}_{problem.epilogue.tag.replace('-', '_')}_{problem.store}"
            f"_{c.bm}x{c.bn}x{c.bk}_w{c.warps_m}x{c.warps_n}_s{c.stages}")


def render_gemm(problem: GemmProblem, config: GemmConfig) -> Source:
    """The CUDA source for ``problem`` with ``config`` (one ``extern "C"`` kernel)."""
    if problem.store not in STORES:
        raise ValueError(f"store {problem.store!r} not in {STORES}")
    name = kernel_name(problem, config)
    return render(TEMPLATE, name, (name,), NAME=name, DTYPE=DTYPES[problem.dtype],
                  BM=config.bm, BN=config.bn, BK=config.bk, WARPS_M=config.warps_m,
                  WARPS_N=config.warps_n, STAGES=config.stages,
                  STORE_HEADS=int(problem.store == "heads"),
                  **problem.epilogue.template_values())


C = TypeVar("C")


class GemmSegmentFamily(KernelFamily[GemmProblem, C]):
    """What every family of ``gemm`` and ``gemm_norm`` segments shares: the problem
    (``x[M, K0] @ w0 -> [M, N0]`` and the last epilogue), the tuning key and the reference."""

    def problem(self, seg: SegmentView, ctx: PlanContext) -> GemmProblem:
        return GemmProblem(ctx.tokens, seg.dim("n0"), seg.dim("k0"), ctx.dtype,
                           seg.epilogues[-1], ctx.store)

    def tuning_key(self, problem: GemmProblem, profile: GpuProfile,
                   identities: tuple[Any, ...]) -> tuple[Any, ...]:
        p = problem
        return ("tokens", p.m, p.n, p.k, p.dtype, p.epilogue.tag, p.store, *identities,
                profile.arch)

    def widths(self, seg: SegmentView) -> tuple[int, int]:
        """(width of ``x``, width of the output) of a segment of this kind."""
        return seg.dim("k0"), seg.dim("n0")

    def reference(self, seg: SegmentView, act: Any, param: Any, kn: Any,
                  extra: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
        """``(out, pre_norm)`` of the segment in float64 (see
        :func:`stofc.plan.reference.reference_segment` for the callables)."""
        return apply_epilogue(act("x") @ kn("w0"), seg.epilogues[-1], bias=param("b0"), **extra)


class GemmTemplateFamily(GemmSegmentFamily[GemmConfig]):
    """The hand-written template (``gemm/gemm.cu.j2``) as a family of one segment kind."""

    templates = (TEMPLATE,)
    config_type = GemmConfig
    preference = 10
    space_order = 0
    tuner_tag = (("impl", "mma"),)

    def space(self, problem: GemmProblem, profile: GpuProfile) -> Space:
        return space(problem, profile)

    def candidates(self, problem: GemmProblem, profile: GpuProfile
                   ) -> tuple[list[GemmConfig], dict[str, int]]:
        configs, reasons = super().candidates(problem, profile)
        return configs, {f"mma: {k}": v for k, v in reasons.items()}

    def default(self, problem: GemmProblem, profile: GpuProfile) -> GemmConfig:
        return default_config(problem, profile)

    def spec(self, problem: GemmProblem, config: GemmConfig) -> KernelSpec:
        return KernelSpec(problem.segment, TEMPLATE, (("dtype", problem.dtype),
                                                      ("store", problem.store),
                                                      *config.as_params()))

    def config_of(self, spec: KernelSpec, problem: GemmProblem | None) -> GemmConfig:
        return GemmConfig(*(spec.param(k) for k in ("bm", "bn", "bk", "warps_m", "warps_n",
                                                     "stages")))

    def kernels(self, problem: GemmProblem, config: GemmConfig) -> tuple[KernelInstance, ...]:
        return (KernelInstance(self.name, problem, config, kernel_name(problem, config)),)

    def render(self, kernel: KernelInstance) -> Source:
        return render_gemm(kernel.problem, kernel.config)


@register
class Gemm(GemmTemplateFamily):
    """``gemm`` segments (no norm) on the hand-written template."""

    name = "gemm"
    segments = ("gemm",)
