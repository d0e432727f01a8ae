"""Add + LayerNorm / RMSNorm (family ``add_norm``): template ``norm/add_norm.cu.j2``.

Memory-bound, one pass: each row is read once with 16-byte vector loads
(8 elements), held in registers, reduced (two-pass variance from registers),
and written once. With ``norm="none"`` the same kernel is the vendor path's
fused epilogue (bias, activation, residual after a cuBLAS GEMM: the
:mod:`stofc.kernels.vendor_gemm` family's kernels and the CUDA twins' epilogue
passes are this family's).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from stofc.codegen import Source, render
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

FAMILY = "add_norm"
TEMPLATE = "norm/add_norm.cu.j2"
VEC = 8  # elements per 16-byte access (fp16/bf16)


@dataclass(frozen=True)
class NormProblem:
    """Rows of width ``n`` (``m`` a hint), dtype, and the epilogue to apply."""

    m: int
    n: int
    dtype: str
    epilogue: Epilogue
    input_fp32: bool = False  # x is fp32 (a split GEMM+GEMM's partial sums; a bf16 pre-LN sum)
    params_fp32: bool = False  # gamma / beta are fp32 (bf16 packages keep LN parameters fp32)


@dataclass(frozen=True)
class NormConfig:
    """Threads per row (whole warps) and rows per block."""

    tpr: int
    rows: int

    def items(self, n: int) -> int:
        """16-byte vectors each thread holds for a row of ``n``."""
        return -(-n // (VEC * self.tpr))

    def as_params(self) -> tuple[tuple[str, int], ...]:
        return tuple(asdict(self).items())


def _constraints(env: dict) -> None:
    items = -(-env["n"] // (VEC * env["tpr"]))
    check(env["tpr"] * env["rows"] <= 1024, "at most 1024 threads per block")
    check(env["tpr"] * env["rows"] >= 64, "fewer than 2 warps per block under-fills the SM")
    check(items <= 8, "more than 8 vectors (64 floats) per thread spill registers")
    check(items * VEC * env["tpr"] <= 2 * env["n"],
          "over half the row's vector slots are out of range (too many threads per row)")


def space(problem: NormProblem, profile: GpuProfile | None = None) -> Space:
    """Threads-per-row and rows-per-block candidates."""
    del profile
    # whole warps: powers of two, three times them, which hidden sizes that are multiples of
    # 768 fill exactly (768, 1536, 3072 with one vector per thread), and the default's (five
    # warps for 1280), so the tuner measures the config an untuned package runs
    tprs = sorted({32, 64, 96, 128, 192, 256, 384, 512, default_config(problem).tpr})
    return Space(axes=(("tpr", tuple(tprs)), ("rows", (1, 2, 4, 8))),
                 constraints=(_constraints,), fixed=(("n", problem.n),))


def default_config(problem: NormProblem, profile: GpuProfile | None = None) -> NormConfig:
    """One vector per thread where the row allows it (up to 512 threads: rows of 4096), in
    whole warps (three for BERT-base's 768); 128 threads per block where a row takes fewer,
    and two rows of three warps.

    Measured (H100, fp16 residual + LayerNorm, ``bench/add_norm_configs.py``,
    ``add-norm-configs-h100-2026-11-27.jsonl``): at (8192, 768) three warps x two rows ran
    14.3 us against 15.3 for the previous rule's two warps x two vectors (-7%), 26.6 against
    29.6 at (16384, 768); one vector per thread was the fastest or within 1% of it at every
    measured width (768, 1024, 4096), and 128 threads per block (1024, 4096) within 1% of the
    best block size."""
    del profile
    vectors = -(-problem.n // VEC)
    tpr = min(512, -(-vectors // 32) * 32)
    rows = 2 if tpr == 96 else max(1, 128 // tpr)   # 96 x 2: 14.3 us, 96 x 1: 14.6
    return NormConfig(tpr, rows)


def kernel_name(problem: NormProblem, config: NormConfig) -> str:
    fp32 = ("_f32in" if problem.input_fp32 else "") + ("_f32p" if problem.params_fp32 else "")
    return (f"stofc_add_norm_{problem.dtype}{fp32}_{problem.epilogue.tag.replace('-', '_')}"
            f"_n{problem.n}_t{config.tpr}x{config.rows}")


def render_norm(problem: NormProblem, config: NormConfig) -> Source:
    """The CUDA source for ``problem`` with ``config`` (one ``extern "C"`` kernel)."""
    name = kernel_name(problem, config)
    src = render(TEMPLATE, name, (name,), NAME=name, DTYPE=DTYPES[problem.dtype],
                 XTYPE="float" if problem.input_fp32 else DTYPES[problem.dtype],
                 PTYPE="float" if problem.params_fp32 else "T",
                 TPR=config.tpr, ROWS=config.rows, ITEMS=config.items(problem.n),
                 **problem.epilogue.template_values())
    if not problem.params_fp32:
        # PTYPE = T renders the code of before the option; keep the recorded params so
        # too (plan.json of float16 packages stays byte-for-byte the same)
        src = replace(src, params=tuple(p for p in src.params if p[0] != "PTYPE"))
    return src


@register
class AddNorm(KernelFamily[NormProblem, NormConfig]):
    """``add_norm`` segments (bias?, activation?, residual?, norm?) in one memory pass."""

    name = FAMILY
    segments = ("add_norm",)
    templates = (TEMPLATE,)
    config_type = NormConfig
    preference = 10

    def problem(self, seg: SegmentView, ctx: PlanContext) -> NormProblem:
        return NormProblem(ctx.tokens, seg.dim("n"), ctx.dtype, seg.epilogues[-1])

    def space(self, problem: NormProblem, profile: GpuProfile) -> Space:
        return space(problem, profile)

    def default(self, problem: NormProblem, profile: GpuProfile) -> NormConfig:
        return default_config(problem, profile)

    def spec(self, problem: NormProblem, config: NormConfig) -> KernelSpec:
        return KernelSpec(FAMILY, TEMPLATE, (("dtype", problem.dtype), ("n", problem.n),
                                             *config.as_params()))

    def config_of(self, spec: KernelSpec, problem: NormProblem | None) -> NormConfig:
        return NormConfig(int(spec.param("tpr")), int(spec.param("rows")))

    def twin_epilogue_config(self, spec: KernelSpec) -> NormConfig | None:
        if spec.param("tpr") and spec.param("rows"):
            return NormConfig(int(spec.param("tpr")), int(spec.param("rows")))
        return None

    def tuning_key(self, problem: NormProblem, profile: GpuProfile,
                   identities: tuple[Any, ...]) -> tuple[Any, ...]:
        return ("tokens", problem.m, problem.n, problem.dtype, problem.epilogue.tag,
                *identities, profile.arch)

    def widths(self, seg: SegmentView) -> tuple[int, int]:
        return seg.dim("n"), seg.dim("n")

    def reference(self, seg: SegmentView, act: Any, param: Any, kn: Any,
                  extra: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
        return apply_epilogue(act("x"), seg.epilogues[-1], bias=param("bias"), **extra)

    def kernels(self, problem: NormProblem, config: NormConfig) -> tuple[KernelInstance, ...]:
        return (KernelInstance(self.name, problem, config, kernel_name(problem, config)),)

    def render(self, kernel: KernelInstance) -> Source:
        return render_norm(kernel.problem, kernel.config)
