"""GEMM+GEMM (family ``gemm_gemm``): the FFN chain kept on chip, ``gemm/gemm_gemm.cu.j2``.

``out = ep2(ep1(X @ W1ᵀ) @ W2ᵀ)`` with W1 ``[N1, K1]`` and W2 ``[N2, N1]``
(pre-transposed, K contiguous). A block owns ``bm`` rows and every output
column and walks the hidden dimension in chunks of ``bh``; each chunk of the
intermediate lives in shared memory only. Worth it for few tokens, where the
intermediate's round trip and the second launch cost more than the lost
parallelism; the tuner decides by measurement.

Two modes. Direct (``split == 1``, no norm): the block applies ep2 and stores.
Workspace (``split > 1`` or a norm in ep2): ``split`` blocks share the hidden
dimension and add fp32 partial sums into a zeroed ``[M, N2]`` workspace; the
Add+Norm template (fp32 input) then applies ep2 and the optional row norm.
Splitting restores parallelism when ``M / bm`` row blocks under-fill the GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from stofc.codegen import Source, render
from stofc.errors import PlanError
from stofc.kernels import norm as norm_family
from stofc.kernels.epilogue import Epilogue
from stofc.kernels.gemm import DTYPES
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

TEMPLATE = "gemm/gemm_gemm.cu.j2"


@dataclass(frozen=True)
class GemmGemmProblem:
    m: int
    k1: int
    n1: int
    n2: int
    dtype: str
    ep1: Epilogue
    ep2: Epilogue


@dataclass(frozen=True)
class GemmGemmConfig:
    bm: int
    bh: int
    bk: int
    warps: int
    stages: int
    split: int = 1

    def to_workspace(self, p: GemmGemmProblem) -> bool:
        """Whether the partial sums go to the fp32 workspace (split or norm)."""
        return self.split > 1 or p.ep2.norm != "none"

    def n2_pad(self, n2: int) -> int:
        step = 16 * self.warps
        return -(-n2 // step) * step

    def smem_bytes(self, p: GemmGemmProblem) -> int:
        x = self.bm * (p.k1 + 8)
        w1 = self.stages * self.bh * (self.bk + 8)
        f = self.bm * (self.bh + 8)
        w2 = self.n2_pad(p.n2) * (self.bh + 8)
        return 2 * (x + w1 + f + w2)

    def as_params(self) -> tuple[tuple[str, int], ...]:
        return tuple(asdict(self).items())


def problem_of(match: SegmentView, tokens: int, dtype: str) -> GemmGemmProblem:
    """The problem of a ``gemm_gemm`` segment (or :class:`~stofc.plan.families.SegmentMatch`)."""
    return GemmGemmProblem(tokens, match.dim("k0"), match.dim("n0"), match.dim("n1"), dtype,
                           match.epilogues[0], match.epilogues[1])


def _constraints(env: dict) -> None:
    cfg = GemmGemmConfig(env["bm"], env["bh"], env["bk"], env["warps"], env["stages"])
    p: GemmGemmProblem = env["problem"]
    check((env["bh"] // env["warps"]) % 16 == 0,
          "each warp's share of a hidden chunk must be a multiple of 16 columns")
    check(p.n1 % (env["bh"] * env["split"]) == 0,
          "the hidden size must be a multiple of chunk x split")
    row_blocks = -(-p.m // env["bm"])
    check(env["split"] == 1 or row_blocks * env["split"] <= 2 * env["sm_count"],
          "splitting the hidden dimension only pays while blocks do not exceed two waves")
    check(p.k1 % env["bk"] == 0, "K must be a multiple of BK")
    acc = (env["bm"] // 16) * (cfg.n2_pad(p.n2) // env["warps"] // 8) * 4
    check(acc <= 128, "more than 128 fp32 output accumulators per thread spill registers")
    check(cfg.smem_bytes(p) <= env["smem_per_block"],
          "X tile + W1 stages + chunk + W2 chunk exceed one block's shared memory")


def space(problem: GemmGemmProblem, profile: GpuProfile) -> Space:
    return Space(axes=(("bm", (16, 32)), ("bh", (32, 64, 96, 128)), ("bk", (32, 64)),
                       ("warps", (2, 4, 6, 8)), ("stages", (2, 3)), ("split", (1, 2, 4, 8, 16))),
                 constraints=(_constraints,),
                 fixed=(("problem", problem), ("smem_per_block", profile.smem_per_block),
                        ("sm_count", profile.sm_count)))


def default_config(problem: GemmGemmProblem, profile: GpuProfile) -> GemmGemmConfig:
    """The first valid of a short preference list (16-row blocks, 64-wide chunks first)."""
    sp = space(problem, profile)
    row_blocks = -(-problem.m // 16)
    splits = [s for s in (16, 8, 4, 2) if row_blocks * s <= profile.sm_count] + [1]
    for bm, bh, warps, stages in ((16, 64, 4, 3), (16, 64, 4, 2), (16, 32, 2, 2),
                                  (16, 64, 8, 2)):
        for split in splits:
            cfg = {"bm": bm, "bh": bh, "bk": 32, "warps": warps, "stages": stages,
                   "split": split}
            if sp.reason(cfg) is None:
                return GemmGemmConfig(**cfg)
    valid = sp.configs()
    if not valid:
        raise PlanError(f"no GEMM+GEMM configuration fits {problem.k1}x{problem.n1}x{problem.n2} "
                        f"on {profile.name} ({sp.explain()})",
                        hint="split the FFN chain into two GEMM segments")
    return GemmGemmConfig(**valid[0])


def kernel_name(p: GemmGemmProblem, c: GemmGemmConfig) -> str:
    return (f"stofc_gemm_gemm_{p.dtype}_{p.ep1.tag.replace('-', '_')}_"
            f"{p.ep2.tag.replace('-', '_')}_{p.k1}x{p.n1}x{p.n2}_m{c.bm}_h{c.bh}_k{c.bk}"
            f"_w{c.warps}_s{c.stages}_x{c.split}")


def render_gemm_gemm(p: GemmGemmProblem, c: GemmGemmConfig) -> Source:
    name = kernel_name(p, c)
    e1, e2 = p.ep1.template_values(), p.ep2.template_values()
    return render(TEMPLATE, name, (name,), NAME=name, DTYPE=DTYPES[p.dtype], BM=c.bm, BH=c.bh,
                  BK=c.bk, WARPS=c.warps, STAGES=c.stages, K1=p.k1, N1=p.n1, N2=p.n2,
                  N2_PAD=c.n2_pad(p.n2), HAS_BIAS1=e1["HAS_BIAS"], ACT1=e1["ACT"],
                  HAS_BIAS2=e2["HAS_BIAS"], ACT2=e2["ACT"], HAS_RESIDUAL2=e2["HAS_RESIDUAL"],
                  TO_WORKSPACE=int(c.to_workspace(p)), SPLIT=c.split)


@register
class GemmGemm(KernelFamily[GemmGemmProblem, GemmGemmConfig]):
    """``gemm_gemm`` segments: the FFN chain on chip (plus the fp32 Add+Norm finisher
    when the partial sums go through the workspace)."""

    name = "gemm_gemm"
    segments = ("gemm_gemm",)
    templates = (TEMPLATE,)
    config_type = GemmGemmConfig
    preference = 10

    def problem(self, seg: SegmentView, ctx: PlanContext) -> GemmGemmProblem:
        return problem_of(seg, ctx.tokens, ctx.dtype)

    def space(self, problem: GemmGemmProblem, profile: GpuProfile) -> Space:
        return space(problem, profile)

    def default(self, problem: GemmGemmProblem, profile: GpuProfile) -> GemmGemmConfig:
        return default_config(problem, profile)

    def spec(self, problem: GemmGemmProblem, config: GemmGemmConfig) -> KernelSpec:
        return KernelSpec("gemm_gemm", TEMPLATE, (("dtype", problem.dtype), *config.as_params()))

    def config_of(self, spec: KernelSpec, problem: GemmGemmProblem | None) -> GemmGemmConfig:
        bm, bh, bk, warps, stages = (int(spec.param(k)) for k in ("bm", "bh", "bk", "warps",
                                                                   "stages"))
        return GemmGemmConfig(bm, bh, bk, warps, stages, split=int(spec.param("split", 1)))

    def tuning_key(self, problem: GemmGemmProblem, profile: GpuProfile,
                   identities: tuple[Any, ...]) -> tuple[Any, ...]:
        p = problem
        return ("tokens", p.m, p.k1, p.n1, p.n2, p.dtype, p.ep1.tag, p.ep2.tag, *identities,
                profile.arch)

    def widths(self, seg: SegmentView) -> tuple[int, int]:
        return seg.dim("k0"), seg.dim("n1")

    def reference(self, seg: SegmentView, act: Any, param: Any, kn: Any,
                  extra: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
        hidden, _ = apply_epilogue(act("x") @ kn("w0"), seg.epilogues[0], bias=param("b0"))
        return apply_epilogue(hidden @ kn("w1"), seg.epilogues[-1], bias=param("b1"), **extra)

    def finisher(self, problem: GemmGemmProblem) -> norm_family.NormProblem:
        """The fp32 Add+Norm pass applying ep2 to the workspace (split or norm)."""
        return norm_family.NormProblem(problem.m, problem.n2, problem.dtype, problem.ep2,
                                       input_fp32=True)

    def kernels(self, problem: GemmGemmProblem, config: GemmGemmConfig
                ) -> tuple[KernelInstance, ...]:
        main = KernelInstance(self.name, problem, config, kernel_name(problem, config))
        if not config.to_workspace(problem):
            return (main,)
        nproblem = self.finisher(problem)
        ncfg = norm_family.default_config(nproblem)
        return (main, KernelInstance(norm_family.FAMILY, nproblem, ncfg,
                                     norm_family.kernel_name(nproblem, ncfg), role="finisher"))

    def render(self, kernel: KernelInstance) -> Source:
        return render_gemm_gemm(kernel.problem, kernel.config)
