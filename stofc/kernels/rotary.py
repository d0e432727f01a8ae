"""The rotary position embedding (RoPE) kernel: the ``ai.stofc`` ``Rotary`` op's CUDA twin.

RoPE is part of a layer's attention segment: the frontend records the rotation of Q and K
it found (:class:`~stofc.frontend.types.RopeFusion`), the package writes one ``Rotary``
node in front of ``SparseAttention`` (``cuda/ort/OPS.md``, "Rotary"): it reads the Q, K, V
projection results (separate, or one packed ``[Q | K | V]`` value), rotates every Q and K
head with the model's own cos / sin tables and writes the packed ``[Q' | K' | V]`` that
SparseAttention reads in place. Its CUDA twin launches the kernel of this family
(``rope/rotary.cu.j2``): one memory pass, one thread block per token whose threads walk
its units of ``vec`` elements.

* :class:`RotaryProblem`: what the kernel is compiled for (dtype, head_dim, rotary_dim,
  form); heads, lengths, table layout and position ids are launch arguments.
* :class:`RotaryConfig`: threads per block (the only parameter; not tuned: the pass moves
  ``2 B S (H + 2 Hkv) D`` elements whatever the block).
* :func:`rotary_reference`: the op's function in float64 (numpy), what the CPU twin, the
  CUDA twin and the frontend's recognition are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stofc.codegen import Source, render
from stofc.errors import PlanError
from stofc.kernels.gemm import DTYPES
from stofc.kernels.reference import rope
from stofc.kernels.registry import KernelFamily, KernelInstance, PlanContext, SegmentView, register
from stofc.kernels.space import Space, check
from stofc.kernels.spec import KernelSpec
from stofc.targets import GpuProfile

TEMPLATE = "rope/rotary.cu.j2"
FAMILY = "rotary"
THREADS = (32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class RotaryProblem:
    """The rotation a kernel is compiled for: element type, head_dim ``D``, rotated
    dimensions ``rotary_dim`` (even, ``<= D``) and the form (rotate-half or interleaved)."""

    dtype: str
    head_dim: int
    rotary_dim: int
    interleaved: bool

    @property
    def vec(self) -> int:
        """Elements per vector access: the largest of 8, 4, 2, 1 dividing the head and the
        rotated span a unit walks (half of ``rotary_dim`` rotate-half; interleaved vectors
        hold whole pairs)."""
        span = self.rotary_dim if self.interleaved else self.rotary_dim // 2
        for vec in (8, 4, 2, 1):
            if self.head_dim % vec == 0 and span % vec == 0 and (vec % 2 == 0
                                                                  or not self.interleaved):
                return vec
        raise PlanError(f"rotary_dim {self.rotary_dim} and head_dim {self.head_dim} have no "
                        "vector width", hint="this is a stofc bug; report it")


@dataclass(frozen=True)
class RotaryConfig:
    """Threads per block of the rotary kernel."""

    threads: int = 128


def check_problem(problem: RotaryProblem) -> None:
    """PlanError unless the kernel can be built: fp16/bf16, an even ``rotary_dim`` within
    ``head_dim``."""
    p = problem
    if p.dtype not in DTYPES:
        raise PlanError(f"the rotary kernel takes float16 or bfloat16, not {p.dtype}",
                        hint="compile with --dtype fp16 or bf16")
    if p.rotary_dim <= 0 or p.rotary_dim % 2 or p.rotary_dim > p.head_dim:
        raise PlanError(f"rotary_dim {p.rotary_dim} is not even and within head_dim "
                        f"{p.head_dim}", hint="this is a stofc bug; report it")


def kernel_name(problem: RotaryProblem, config: RotaryConfig) -> str:
    """``stofc_rotary_<dtype>_d<D>_r<rotary_dim>_<rh|il>_v<vec>_t<threads>`` (the CUDA twin
    checks it against the node: ``cuda_attrs.cc``, ``parse_rotary_launch``)."""
    p = problem
    form = "il" if p.interleaved else "rh"
    return (f"stofc_rotary_{p.dtype}_d{p.head_dim}_r{p.rotary_dim}_{form}_v{p.vec}"
            f"_t{config.threads}")


def render_rotary(problem: RotaryProblem, config: RotaryConfig) -> Source:
    """The CUDA source of one rotary kernel (one ``extern "C"`` entry, OPS.md's argument
    list; grid ``B S``: one block per token)."""
    check_problem(problem)
    name = kernel_name(problem, config)
    return render(TEMPLATE, name, (name,), NAME=name, DTYPE=DTYPES[problem.dtype],
                  HEAD_DIM=problem.head_dim, ROTARY_DIM=problem.rotary_dim,
                  INTERLEAVED="true" if problem.interleaved else "false", VEC=problem.vec,
                  THREADS=config.threads,
                  FORM="interleaved pairs" if problem.interleaved else "rotate-half")


def _space_constraints(env: dict) -> None:
    check(env["threads"] >= 64, "fewer than 2 warps per block under-fills the SM")


@register
class Rotary(KernelFamily[RotaryProblem, RotaryConfig]):
    """The ``Rotary`` op's kernel, for the RoPE of a layer's attention segment (module doc).

    Its problem comes from the segment's attention block (``ctx.attention``, whose
    :class:`~stofc.frontend.types.RopeFusion` the package writes as ``Rotary``).
    """

    name = FAMILY
    segments = ("rotary",)
    templates = (TEMPLATE,)
    config_type = RotaryConfig
    tunable = False
    untunable = "the rotary pass moves a fixed number of bytes (one read and one write)"
    untunable_hint = "tune the layers' GEMM and attention segments"

    def problem(self, seg: SegmentView, ctx: PlanContext) -> RotaryProblem:
        block = ctx.attention
        fusion = getattr(block, "rope_fusion", None)
        if fusion is None:
            raise PlanError("the rotary kernel needs an attention block whose RoPE stofc runs",
                            hint="this is a stofc bug; report it")
        return RotaryProblem(ctx.dtype, block.head_dim, fusion.rotary_dim,
                             fusion.form == "interleaved")

    def space(self, problem: RotaryProblem, profile: GpuProfile) -> Space:
        return Space(axes=(("threads", THREADS),), constraints=(_space_constraints,))

    def default(self, problem: RotaryProblem, profile: GpuProfile) -> RotaryConfig:
        return RotaryConfig()

    def spec(self, problem: RotaryProblem, config: RotaryConfig) -> KernelSpec:
        return KernelSpec("rotary", TEMPLATE, (("dtype", problem.dtype),
                                               ("rotary_dim", problem.rotary_dim),
                                               ("interleaved", problem.interleaved),
                                               ("threads", config.threads)))

    def config_of(self, spec: KernelSpec, problem: RotaryProblem | None) -> RotaryConfig:
        return RotaryConfig(int(spec.param("threads", RotaryConfig().threads)))

    def kernels(self, problem: RotaryProblem, config: RotaryConfig
                ) -> tuple[KernelInstance, ...]:
        return (rotary_kernel(problem, config),)

    def render(self, kernel: KernelInstance) -> Source:
        return render_rotary(kernel.problem, kernel.config)


def rotary_kernel(problem: RotaryProblem, config: RotaryConfig | None = None,
                  role: str = "main") -> KernelInstance:
    """The rotary kernel of ``problem`` (default config) as this family's instance."""
    config = config or RotaryConfig()
    check_problem(problem)
    return KernelInstance(FAMILY, problem, config, kernel_name(problem, config), role=role)


# ----------------------------------------------------------------- the launch
ARGUMENTS = ("q", "k", "v", "out", "q_sb", "q_ss", "k_sb", "k_ss", "v_sb", "v_ss", "cos", "sin",
             "t_sb", "W", "pos", "pos_sb", "pos_mode", "rows", "B", "S", "H", "Hkv")
"""The kernel's argument list (OPS.md, "Rotary"), in order."""


@dataclass(frozen=True)
class RotaryLaunch:
    """One launch of the rotary kernel: grid ``B S`` blocks of ``threads``, and its scalar
    arguments by name (the pointers are the run's; packed: ``k = q + H D``,
    ``v = q + (H + Hkv) D`` elements). What the CUDA twin launches (``cuda_rotary.cc``,
    ``check_rotary``) and the GPU tests launch through CuPy."""

    grid: int
    threads: int
    k_offset: int
    v_offset: int
    scalars: tuple[tuple[str, int], ...]

    def scalar(self, name: str) -> int:
        return dict(self.scalars)[name]


def rotary_launch(problem: RotaryProblem, config: RotaryConfig, *, batch: int, seq: int,
                  heads: int, kv_heads: int, packed: bool, table_shape: tuple[int, ...],
                  position_shape: tuple[int, ...] | None = None) -> RotaryLaunch:
    """The launch for inputs of these shapes (``table_shape``: cos's; ``position_shape``:
    position ids', None without them), as the CUDA twin computes it."""
    d = problem.head_dim
    width = (heads + 2 * kv_heads) * d
    q_ss, kv_ss = (width, width) if packed else (heads * d, kv_heads * d)
    t_sb = pos_sb = 0
    if position_shape is None:
        pos_mode, rows = 0, seq
        if len(table_shape) == 3 and table_shape[0] == batch and batch > 1:
            t_sb = seq * table_shape[-1]
    else:
        rows = table_shape[0]
        pos_mode = 2 if tuple(position_shape) == (1,) else 1
        if pos_mode == 1 and position_shape[0] == batch and batch > 1:
            pos_sb = seq
    scalars = {"q_sb": seq * q_ss, "q_ss": q_ss, "k_sb": seq * kv_ss, "k_ss": kv_ss,
               "v_sb": seq * kv_ss, "v_ss": kv_ss, "t_sb": t_sb, "W": table_shape[-1],
               "pos_sb": pos_sb, "pos_mode": pos_mode, "rows": rows, "B": batch, "S": seq,
               "H": heads, "Hkv": kv_heads}
    return RotaryLaunch(batch * seq, config.threads, heads * d if packed else 0,
                        (heads + kv_heads) * d if packed else 0,
                        tuple((n, int(scalars[n])) for n in ARGUMENTS if n in scalars))


# ----------------------------------------------------------------- the op's function
def table_rows(cos: np.ndarray, batch: int, seq: int,
               position_ids: np.ndarray | None = None) -> np.ndarray:
    """The ``[B, S, W]`` cos (or sin) rows the tokens read (OPS.md): without position ids
    ``cos`` is ``[S, W]`` or ``[1 | B, S, W]``; with them it is a ``[P, W]`` cache read at
    row ``position_ids[b, s]`` (``[B | 1, S]``) or ``position_ids[0] + s`` (``[1]``, an
    offset). ValueError for another shape or a row outside the cache."""
    t = np.asarray(cos)
    if position_ids is None:
        if t.ndim == 2 and t.shape[0] == seq:
            return np.broadcast_to(t[None], (batch, *t.shape))
        if t.ndim == 3 and t.shape[0] in (1, batch) and t.shape[1] == seq:
            return np.broadcast_to(t, (batch, *t.shape[1:]))
        raise ValueError(f"a table of shape {list(t.shape)} is not [S, W] or [1|B, S, W] "
                         f"for B={batch}, S={seq}")
    pos = np.asarray(position_ids).astype(np.int64)
    if t.ndim != 2:
        raise ValueError(f"with position ids the table is a [P, W] cache, not {list(t.shape)}")
    if pos.shape == (1,):
        rows = np.broadcast_to(pos[0] + np.arange(seq), (batch, seq))
    elif pos.ndim == 2 and pos.shape[0] in (1, batch) and pos.shape[1] == seq:
        rows = np.broadcast_to(pos, (batch, seq))
    else:
        raise ValueError(f"position ids of shape {list(pos.shape)} are not [1], [1, S] or "
                         f"[B, S] for B={batch}, S={seq}")
    if rows.size and (rows.min() < 0 or rows.max() >= t.shape[0]):
        raise ValueError(f"position ids reach rows {int(rows.min())}..{int(rows.max())} of a "
                         f"{t.shape[0]}-row cache")
    return t[rows]


def rotary_reference(q: np.ndarray, k: np.ndarray | None, v: np.ndarray | None,
                     cos: np.ndarray, sin: np.ndarray, *, num_heads: int, kv_heads: int,
                     head_dim: int, rotary_dim: int, interleaved: bool,
                     position_ids: np.ndarray | None = None) -> np.ndarray:
    """``Rotary``'s output in float64: ``[B, S, (H + 2 Hkv) D]`` = ``[Q' | K' | V]``.

    ``q`` is ``[B, S, H D]`` with ``k``, ``v`` ``[B, S, Hkv D]``, or (``k`` and ``v`` None)
    the packed ``[B, S, (H + 2 Hkv) D]``; cos / sin as :func:`table_rows` takes them; each
    Q and K head is rotated by :func:`~stofc.kernels.reference.rope`, V is copied.
    """
    h, hkv, d = num_heads, kv_heads, head_dim
    if k is None or v is None:
        packed = np.asarray(q, np.float64)
        q, k, v = (packed[..., :h * d], packed[..., h * d:(h + hkv) * d],
                   packed[..., (h + hkv) * d:])
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    batch, seq = q.shape[:2]
    c = table_rows(cos, batch, seq, position_ids)[:, :, None, :]
    s = table_rows(sin, batch, seq, position_ids)[:, :, None, :]

    def rotated(x: np.ndarray, heads: int) -> np.ndarray:
        y = rope(x.reshape(batch, seq, heads, d), c, s, rotary_dim, interleaved)
        return y.reshape(batch, seq, heads * d)

    return np.concatenate([rotated(q, h), rotated(k, hkv), v], axis=-1)


__all__ = ["ARGUMENTS", "FAMILY", "TEMPLATE", "Rotary", "RotaryConfig", "RotaryLaunch",
           "RotaryProblem", "check_problem", "kernel_name", "render_rotary", "rotary_kernel",
           "rotary_launch", "rotary_reference", "table_rows"]
