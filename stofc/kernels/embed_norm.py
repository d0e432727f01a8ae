"""The embedding + LayerNorm kernel (family ``embed_norm``): the ``EmbedLayerNorm`` op's CUDA twin.

HF BERT's embedding is ``LayerNorm(words[input_ids] + token_types[token_type_ids] +
positions[position_ids])``. :mod:`stofc.lower.embed` writes such a region as one
``ai.stofc`` ``EmbedLayerNorm`` node (``cuda/ort/OPS.md``); its CUDA twin launches this
family's kernel (``norm/embed_norm.cu.j2``): one memory pass, each token's row gathered
from the (up to three) tables with 16-byte vector loads, summed in float32 in the
model's order, held in registers, normalised (two-pass variance from registers, float32)
and written once.

* :class:`EmbedNormProblem`: what the kernel is compiled for (dtype, width C, summands,
  beta, float32 gamma / beta); ids, their shapes and types, and the table sizes are launch
  arguments (:func:`embed_norm_launch`).
* :class:`EmbedNormConfig`: threads per row (whole warps) and rows per block; not tuned
  (the pass moves a fixed number of bytes).
* :func:`embed_norm_reference`: the op's function in float64 (numpy), what the twins are
  checked against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from stofc.codegen import Source, render
from stofc.errors import PlanError
from stofc.kernels.gemm import DTYPES
from stofc.kernels.reference import layernorm
from stofc.kernels.registry import KernelFamily, KernelInstance, PlanContext, SegmentView, register
from stofc.kernels.space import Space, check
from stofc.kernels.spec import KernelSpec
from stofc.targets import GpuProfile

FAMILY = "embed_norm"
TEMPLATE = "norm/embed_norm.cu.j2"
VEC = 8            # elements per 16-byte access (fp16/bf16)
MAX_SUMMANDS = 3
MAX_ITEMS = 8      # 16-byte vectors per thread (64 floats): more spills registers


@dataclass(frozen=True)
class EmbedNormProblem:
    """Rows of ``width`` C in ``dtype`` gathered from ``summands`` tables (1 to 3), normalised
    with gamma and (``has_beta``) beta, float32 when ``params_fp32`` (bfloat16 packages)."""

    dtype: str
    width: int
    summands: int
    has_beta: bool
    params_fp32: bool = False


@dataclass(frozen=True)
class EmbedNormConfig:
    """Threads per row (whole warps) and rows per block."""

    tpr: int
    rows: int

    def items(self, width: int) -> int:
        """16-byte vectors each thread holds for a row of ``width``."""
        return -(-width // (VEC * self.tpr))

    def as_params(self) -> tuple[tuple[str, int], ...]:
        return tuple(asdict(self).items())


def check_problem(problem: EmbedNormProblem) -> None:
    """PlanError unless the kernel can be built: fp16/bf16, 1 to 3 summands, a width that
    is a positive multiple of 8 (16-byte vectors)."""
    p = problem
    if p.dtype not in DTYPES:
        raise PlanError(f"the EmbedLayerNorm kernel takes float16 or bfloat16, not {p.dtype}",
                        hint="compile with --dtype fp16 or bf16")
    if not 1 <= p.summands <= MAX_SUMMANDS:
        raise PlanError(f"the EmbedLayerNorm kernel sums 1 to {MAX_SUMMANDS} tables, not "
                        f"{p.summands}", hint="this is a stofc bug; report it")
    if p.width <= 0 or p.width % VEC:
        raise PlanError(f"the EmbedLayerNorm kernel reads rows in {VEC}-element vectors; width "
                        f"{p.width} is not a positive multiple of {VEC}",
                        hint="this is a stofc bug; report it")


def supported_width(width: int) -> bool:
    """Whether a row of ``width`` has a kernel (what the rewrite asks before it emits the op)."""
    return width > 0 and width % VEC == 0 and -(-width // (VEC * 512)) <= MAX_ITEMS


def default_config(problem: EmbedNormProblem) -> EmbedNormConfig:
    """One warp per row while each thread holds at most 4 vectors (C <= 1024: BERT-base's
    768 is 3 vectors a lane, no idle lane), else more warps per row; 4 warps per block."""
    tpr = 32
    while tpr < 512 and -(-problem.width // (VEC * tpr)) > 4:
        tpr *= 2
    return EmbedNormConfig(tpr, max(1, 128 // tpr))


def _constraints(env: dict) -> None:
    items = -(-env["n"] // (VEC * env["tpr"]))
    check(env["tpr"] * env["rows"] <= 1024, "at most 1024 threads per block")
    check(env["tpr"] * env["rows"] >= 64, "fewer than 2 warps per block under-fills the SM")
    check(items <= MAX_ITEMS, "more than 8 vectors (64 floats) per thread spill registers")
    check(items * VEC * env["tpr"] <= 2 * env["n"],
          "over half the row's vector slots are out of range (too many threads per row)")


def kernel_name(problem: EmbedNormProblem, config: EmbedNormConfig) -> str:
    """``stofc_embed_norm_<dtype>[_f32p]_e<summands>_<ln|ln_ns>_n<C>_t<tpr>x<rows>`` (the CUDA
    twin parses it: ``cuda_attrs.cc``, ``parse_embed_norm_launch``)."""
    p = problem
    return (f"stofc_embed_norm_{p.dtype}{'_f32p' if p.params_fp32 else ''}_e{p.summands}_"
            f"{'ln' if p.has_beta else 'ln_ns'}_n{p.width}_t{config.tpr}x{config.rows}")


def render_embed_norm(problem: EmbedNormProblem, config: EmbedNormConfig) -> Source:
    """The CUDA source of one kernel (one ``extern "C"`` entry, OPS.md's argument list)."""
    check_problem(problem)
    items = config.items(problem.width)
    if items > MAX_ITEMS or config.tpr % 32 or config.tpr * config.rows > 1024:
        raise PlanError(f"EmbedLayerNorm config {config} does not fit a row of {problem.width}",
                        hint="this is a stofc bug; report it")
    name = kernel_name(problem, config)
    return render(TEMPLATE, name, (name,), NAME=name, DTYPE=DTYPES[problem.dtype],
                  PTYPE="float" if problem.params_fp32 else "T", SUMMANDS=problem.summands,
                  HAS_BETA=int(problem.has_beta), TPR=config.tpr, ROWS=config.rows, ITEMS=items)


@register
class EmbedNorm(KernelFamily[EmbedNormProblem, EmbedNormConfig]):
    """The ``EmbedLayerNorm`` op's kernel (module doc). No plan segment runs it: the
    embedding is not a layer's segment; :func:`stofc.lower.twins.annotate_cuda` asks for it
    for each EmbedLayerNorm node the package writes."""

    name = FAMILY
    segments = ("embed_norm",)
    templates = (TEMPLATE,)
    config_type = EmbedNormConfig
    tunable = False
    untunable = "the embedding pass moves a fixed number of bytes (gathered rows in, one out)"
    untunable_hint = "tune the layers' GEMM and attention segments"

    def problem(self, seg: SegmentView, ctx: PlanContext) -> EmbedNormProblem:
        raise PlanError("no plan segment runs the EmbedLayerNorm kernel",
                        hint="this is a stofc bug; report it")

    def space(self, problem: EmbedNormProblem, profile: GpuProfile) -> Space:
        return Space(axes=(("tpr", (32, 64, 128, 256, 512)), ("rows", (1, 2, 4, 8))),
                     constraints=(_constraints,), fixed=(("n", problem.width),))

    def default(self, problem: EmbedNormProblem, profile: GpuProfile) -> EmbedNormConfig:
        return default_config(problem)

    def spec(self, problem: EmbedNormProblem, config: EmbedNormConfig) -> KernelSpec:
        return KernelSpec(FAMILY, TEMPLATE, (("dtype", problem.dtype), ("n", problem.width),
                                             *config.as_params()))

    def config_of(self, spec: KernelSpec, problem: EmbedNormProblem | None) -> EmbedNormConfig:
        return EmbedNormConfig(int(spec.param("tpr")), int(spec.param("rows")))

    def kernels(self, problem: EmbedNormProblem, config: EmbedNormConfig
                ) -> tuple[KernelInstance, ...]:
        return (embed_norm_kernel(problem, config),)

    def render(self, kernel: KernelInstance) -> Source:
        return render_embed_norm(kernel.problem, kernel.config)


def embed_norm_kernel(problem: EmbedNormProblem, config: EmbedNormConfig | None = None
                      ) -> KernelInstance:
    """The kernel of ``problem`` (default config) as this family's instance."""
    check_problem(problem)
    config = config or default_config(problem)
    return KernelInstance(FAMILY, problem, config, kernel_name(problem, config))


# ----------------------------------------------------------------- the launch
ARGUMENTS = ("ids0", "ids1", "ids2", "table0", "table1", "table2", "gamma", "beta", "out",
             "sb0", "ss0", "sb1", "ss1", "sb2", "ss2", "V0", "V1", "V2", "ids32", "B", "S", "C",
             "eps")
"""The kernel's argument list (OPS.md, "EmbedLayerNorm" under the CUDA twins), in order."""
I64 = frozenset({"sb0", "ss0", "sb1", "ss1", "sb2", "ss2", "V0", "V1", "V2"})
"""The ``long long`` arguments (``eps`` is float, the other scalars int)."""


@dataclass(frozen=True)
class EmbedNormLaunch:
    """One launch: grid ``ceil(B S / rows)`` blocks of ``threads``, its scalar arguments by
    name (the present summands in slots ``0 .. summands-1``; the other slots' scalars 0)."""

    grid: int
    threads: int
    scalars: tuple[tuple[str, int | float], ...]

    def scalar(self, name: str) -> int | float:
        return dict(self.scalars)[name]


def broadcast_ids(shapes: Sequence[tuple[int, ...] | None]) -> tuple[int, int]:
    """``(B, S)`` of ids of ``shapes`` (each ``[B or 1, S or 1]``; ``None``: a table gathered
    by position, which adds no shape), ValueError otherwise."""
    given = [s for s in shapes if s is not None]
    if not given or any(len(s) != 2 for s in given):
        raise ValueError(f"ids of shapes {[list(s) for s in given]} are not all [B, S]")
    out = []
    for axis in (0, 1):
        dims = {s[axis] for s in given} - {1}
        if len(dims) > 1:
            raise ValueError(f"ids of shapes {[list(s) for s in given]} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return out[0], out[1]


def embed_norm_launch(problem: EmbedNormProblem, config: EmbedNormConfig, *,
                      ids_shapes: Sequence[tuple[int, ...] | None], table_rows: Sequence[int],
                      ids32: Sequence[bool] = (), eps: float = 1e-12) -> EmbedNormLaunch:
    """The launch for ids of ``ids_shapes`` into tables of ``table_rows`` rows (one per
    present summand, in order; ``ids32[i]``: ids i are int32; ``None``: no ids, rows by
    position, the kernel's null ids with strides 0 and 1), as the CUDA twin computes it."""
    batch, seq = broadcast_ids(ids_shapes)
    scalars: dict[str, int | float] = {f"{k}{i}": 0 for i in range(MAX_SUMMANDS)
                                       for k in ("sb", "ss", "V")}
    for i, (shape, rows) in enumerate(zip(ids_shapes, table_rows, strict=True)):
        scalars[f"sb{i}"] = shape[1] if shape is not None and shape[0] > 1 else 0
        scalars[f"ss{i}"] = 1 if shape is None or shape[1] > 1 else 0
        scalars[f"V{i}"] = rows
    scalars |= {"ids32": sum(1 << i for i, flag in enumerate(ids32) if flag), "B": batch,
                "S": seq, "C": problem.width, "eps": float(np.float32(eps))}
    tokens = batch * seq
    return EmbedNormLaunch(-(-tokens // config.rows), config.tpr * config.rows,
                           tuple((n, scalars[n]) for n in ARGUMENTS if n in scalars))


# ----------------------------------------------------------------- the op's function
def embed_norm_reference(ids: Sequence[np.ndarray | None], tables: Sequence[np.ndarray],
                         gamma: np.ndarray, beta: np.ndarray | None, eps: float) -> np.ndarray:
    """``EmbedLayerNorm``'s output ``[B, S, C]`` in float64: ``LayerNorm(sum_i
    tables[i][ids[i]])`` with the ids broadcast to ``[B, S]`` (``None``: the sequence
    position) and negative ids counted from the end (ONNX Gather). ValueError for ids outside
    ``[-V, V)`` or that do not broadcast."""
    batch, seq = broadcast_ids([None if i is None else tuple(np.shape(i)) for i in ids])
    total: np.ndarray | None = None
    for i, (index, table) in enumerate(zip(ids, tables, strict=True)):
        index = np.broadcast_to(np.arange(seq, dtype=np.int64) if index is None
                                else np.asarray(index, np.int64), (batch, seq))
        rows = len(table)
        if index.size and (index.min() < -rows or index.max() >= rows):
            raise ValueError(f"ids {i} reach {int(index.min())}..{int(index.max())}, outside "
                             f"[{-rows}, {rows})")
        part = np.asarray(table, np.float64)[np.where(index < 0, index + rows, index)]
        total = part if total is None else total + part
    if total is None:
        raise ValueError("EmbedLayerNorm sums at least one table")
    return layernorm(total, gamma, beta, eps)


__all__ = ["ARGUMENTS", "FAMILY", "I64", "TEMPLATE", "EmbedNorm", "EmbedNormConfig",
           "EmbedNormLaunch", "EmbedNormProblem", "broadcast_ids", "check_problem",
           "default_config", "embed_norm_kernel", "embed_norm_launch", "embed_norm_reference",
           "kernel_name", "render_embed_norm", "supported_width"]
