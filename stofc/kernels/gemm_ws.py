"""The Hopper GEMM with a fused bias + activation epilogue (``gemm/gemm_ws.cu.j2``, sm_90a).

``out[M, N] = act(x[M, K] @ w[K, N] + bias[N])`` in fp16 or bf16 with fp32 accumulation, w
read as the package stores it (row-major ``[K, N]``, OPS.md's FusedGemm operand). It exists
for the FFN's first GEMM: cuBLASLt folds the bias and the tanh GELU into its epilogue but
not the erf GELU (nor SiLU, ReLU), so a package runs that node as cuBLASLt plus a memory
pass over the ``[M, 4C]`` activation (BERT-base at 8192 tokens: 63.7 + 38 us per layer,
H100). This kernel applies the activation to the fp32 accumulators before the one store:
79.5 us (1.29x) at that shape, and more exact (one rounding instead of two).
``bench/gemm_ws.py`` measures it; ``bench/results/gemm-ws-h100-2026-11-27.*`` holds the runs
behind :data:`DEFAULT`.

Structure (the template's header has the details): one producer thread loads 64 x 64 TMA
boxes of x and w into a ring; two consumer warpgroups issue ``wgmma m64nBNk16`` with w
MN-major (no transpose pass), persistent over the output tiles.

* :class:`GemmWsConfig`: tile width ``bn`` (128 or 256), ring ``stages``, ``coop`` (both
  warpgroups on one 128-row tile, sharing w's panels, or ping-pong over 64-row tiles) and the
  epilogue's staged ``pass_cols``. Why :data:`DEFAULT` (same-call H100 runs, fp16):
  cooperative 128 x 256 with four stages ran 79.5 us at (8192, 768, 3072) + GELU against
  84.0 with three stages, 91.8 for 128 x 128 and 109.9 for ping-pong 64 x 256, whose
  per-warpgroup tiles read w twice as often from L2 (the bound there: ~9-11 TB/s of L2
  reads). Four stages of 48 KB leave room for 64 staged columns per pass, not 128. Tried
  and not kept: 128 x 128 per warpgroup (ping-pong), which matched cuBLASLt without an
  activation (609 TF/s) but ran 88-89 us with the GELU: its epilogue (~20 instructions per
  element, one warp per scheduler) outlasts the other warpgroup's mainloop
  (gemm-ws-wm-tried-h100-2026-11-27.jsonl); the erf GELU is the epilogue's cost (the same
  kernel without it: 66.5-67.0 us). Also tried: the producer warpgroup's three idle warps
  running the epilogue while the consumers start the next tile (the tile staged whole as
  fp16, so three stages): 89.6 us against 81.3 in the same call, 70.2 against 68.2 without an
  activation; three warps cannot issue the GELU's ~20 instructions per element as fast as
  the tensor cores finish a tile (gemm-ws-epi-tried-h100-2026-11-27.{jsonl,patch}). Seven
  epilogue warps (a fourth warpgroup beside those three) do not help either: 512 threads hold
  128 registers each and ptxas compiles every path within that (setmaxnreg does not lift it;
  a 64 x 256 fp32 accumulator fails with C7602), so the tile shrinks to 128 x 192; on an H200,
  same calls in both orders, (8192, 768, 3072) + GELU 76.9 / 79.5 us against 76.7 / 78.2 for
  this default, 9.5-10 us still over its own GEMM alone, and 16K rows 161.4 / 165.3 against
  156.2 / 163.2 (gemm-ws-epi-wg-tried-h200-2026-11-27.{jsonl,patch}). The 192-wide tile with
  the epilogue in the consumers wins where waves are few: 1024 rows 15.2 us against
  17.7-18.2, 2048 rows 24.1-24.3 against 29.1-29.2 (1.45 waves of 128 x 256 tiles on 132 SMs
  against 1.94 of 128 x 192), and loses 2-3% from 8192 rows on; not adopted, since the
  FusedGemm node names one kernel (a per-M choice needs a second). And:
  deferring a tile's epilogue into the next tile's mainloop (acc + bias rounded to 64 packed
  registers, 24/240 register split, one or two 16-column units of the activation after each
  k-step's wgmma issue): correct (the GPU tests passed), level without an activation, but
  97.8-99.1 us against 83.1 with the GELU (one unit per step: 118-121). ncu: tensor pipe 55%
  -> 44% active, 23% more instructions, no pipe saturated: the units run in the warps that
  issue the wgmma, so each step's next wgmma waits for them
  (gemm-ws-defer-tried-h100-2026-11-27.{jsonl,patch}, ...-ncu-...txt). A wgmma issued
  after a path that may exit the tile loop without ``wgmma_wait<0>`` is serialised by ptxas
  (C7518): keep the wait ahead of every exit.
* :func:`render_gemm_ws`: the kernel's source for a problem and config.
* :func:`gemm_ws_grid`: the persistent grid (one block per SM at most).
* :func:`twin_choice`: whether a package's FusedGemm node gets the kernel, and from how many
  rows its CUDA twin launches it (:data:`MIN_ROWS`, :data:`MAX_K`: measured, below).

The ``gemm_ws`` family (:class:`GemmWs`) is registered for the package writer's sake (it
renders and compiles the kernels :func:`stofc.lower.twins.annotate_cuda` asks for); no plan
segment runs it, and neither the tuner nor the CuPy runtime's segments use it yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from stofc.codegen import Source, render
from stofc.errors import PlanError
from stofc.kernels.epilogue import ACTIVATIONS
from stofc.kernels.registry import KernelFamily, KernelInstance, PlanContext, SegmentView, register
from stofc.kernels.space import Space
from stofc.kernels.space import check as space_check
from stofc.kernels.spec import KernelSpec
from stofc.targets import GpuProfile

FAMILY = "gemm_ws"
TEMPLATE = "gemm/gemm_ws.cu.j2"
TARGET = "sm_90a"                 # wgmma, setmaxnreg
COMPILE_OPTIONS: tuple[str, ...] = ("-lineinfo",)
SMEM_LIMIT = 232448               # H100/H200: 227 KB of dynamic shared memory per block
THREADS = 384                     # a producer warpgroup and two consumer warpgroups
PANEL_BYTES = 64 * 128            # a 64 x 64 b16 box, 128-byte swizzled
_CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


@dataclass(frozen=True)
class GemmWsProblem:
    """What a kernel is compiled for; M, N, K are launch arguments."""

    dtype: str
    act: str = "none"
    has_bias: bool = True


@dataclass(frozen=True)
class GemmWsConfig:
    """Tile width, ring depth, cooperative (128-row tiles) or ping-pong (64-row), and the
    epilogue's columns per staged pass."""

    bn: int = 256
    stages: int = 4
    coop: bool = True
    pass_cols: int = 64

    @property
    def bm(self) -> int:
        """Rows of a block tile."""
        return 128 if self.coop else 64

    def smem_bytes(self) -> int:
        """Dynamic shared memory of a launch: the ring, the eight consumer warps' staged
        rows (padded by 16 bytes), the ring's barriers and 1024 bytes of alignment slack."""
        slot = PANEL_BYTES * (self.bm // 64 + self.bn // 64)
        return (self.stages * slot + 8 * 16 * (2 * self.pass_cols + 16) + 16 * self.stages
                + 1024)


DEFAULT = GemmWsConfig()


def check(problem: GemmWsProblem, config: GemmWsConfig) -> None:
    """PlanError unless the kernel can be built for ``problem`` with ``config``."""
    if problem.dtype not in _CTYPES:
        raise PlanError(f"the Hopper GEMM takes float16 or bfloat16, not {problem.dtype}",
                        hint="compile with --dtype fp16 or bf16")
    if problem.act not in ACTIVATIONS:
        raise PlanError(f"activation {problem.act!r} is not one of {ACTIVATIONS}",
                        hint="this is a stofc bug; report it")
    c = config
    if c.bn not in (128, 256) or c.pass_cols not in (64, 128) or c.bn % c.pass_cols:
        raise PlanError(f"tile width {c.bn} / staged pass {c.pass_cols}: the tile is 128 or "
                        "256 columns wide and a pass 64 or 128 of them",
                        hint="this is a stofc bug; report it")
    if c.stages < 2 or c.smem_bytes() > SMEM_LIMIT:
        raise PlanError(f"{c.stages} stages need {c.smem_bytes()} bytes of shared memory "
                        f"(at least 2 stages, at most {SMEM_LIMIT} bytes)",
                        hint="this is a stofc bug; report it")


def entry_name(problem: GemmWsProblem, config: GemmWsConfig) -> str:
    """The kernel's entry point: every value the source depends on, in order."""
    c = config
    return (f"stofc_gemm_ws_{problem.dtype}_{problem.act}_b{int(problem.has_bias)}"
            f"_n{c.bn}_s{c.stages}_{'coop' if c.coop else 'pp'}_p{c.pass_cols}")


def render_gemm_ws(problem: GemmWsProblem, config: GemmWsConfig = DEFAULT) -> Source:
    """The kernel's source (one entry point, :func:`entry_name`)."""
    check(problem, config)
    name = entry_name(problem, config)
    return render(TEMPLATE, name, (name,), DTYPE=_CTYPES[problem.dtype], BN=config.bn,
                  STAGES=config.stages, HAS_BIAS=int(problem.has_bias),
                  ACT=ACTIVATIONS.index(problem.act), COOP=int(config.coop),
                  PASS=config.pass_cols, NAME=name, SMEM_BYTES=config.smem_bytes())


def gemm_ws_tiles(m: int, n: int, config: GemmWsConfig = DEFAULT) -> int:
    """Output tiles of an ``[m, n]`` product."""
    return -(-m // config.bm) * -(-n // config.bn)


def gemm_ws_grid(m: int, n: int, sms: int, config: GemmWsConfig = DEFAULT) -> int:
    """Blocks of the persistent launch: one per tile, at most one per SM."""
    return min(gemm_ws_tiles(m, n, config), sms)


MIN_ROWS = 1024
"""Fewest rows (tokens) a run needs to take the kernel. H100, fp16, K = 768, N = 3072 + GELU,
same call (gemm-ws-msweep-h100-2026-11-27.jsonl) against cuBLASLt plus the activation pass:
0.67x at 128 rows, 0.85x at 512, 1.11x at 1024, 1.03x at 2048, 1.25-1.27x at 4096-16384."""
MAX_K = 1024
"""Largest K the kernel is chosen for: its mainloop runs at ~0.72-0.95x of cuBLASLt's, which
the saved pass over ``[M, N]`` repays only while K is short (1.24x at K = 1024, N = 4096;
0.85x at K = 2048, N = 8192 with SiLU)."""
TWIN_ACTS = ("gelu_erf",)
"""Activations a FusedGemm node takes the kernel for: those cuBLASLt cannot fold (FusedGemm
carries none, gelu_erf or gelu_tanh; the tanh GELU is cuBLASLt's own epilogue)."""


def _constraints(env: dict) -> None:
    cfg = GemmWsConfig(env["bn"], env["stages"], env["coop"], env["pass_cols"])
    space_check(env["bn"] % env["pass_cols"] == 0, "a staged pass must divide the tile width")
    space_check(cfg.smem_bytes() <= SMEM_LIMIT,
                "the ring and the staged rows exceed 227 KB of shared memory")


def twin_choice(*, arch: str, dtype: str, act: str, has_bias: bool, has_residual: bool,
                fp32_out: bool, k: int, n: int) -> GemmWsProblem | None:
    """The problem of the kernel a FusedGemm node's CUDA twin launches for runs of
    :data:`MIN_ROWS` rows or more, or None when the node keeps cuBLASLt and the epilogue
    kernel at every M: not an sm_90 package, an activation cuBLASLt folds, a residual (the
    kernel has none), a float32 output, K above :data:`MAX_K`, K or N below one 64-wide TMA
    box (the GPU tests' smallest) or not multiples of 8."""
    if arch != "sm_90" or dtype not in _CTYPES or act not in TWIN_ACTS or has_residual:
        return None
    if fp32_out or not 64 <= k <= MAX_K or k % 8 or n < 64 or n % 8:
        return None
    return GemmWsProblem(dtype, act, has_bias)


def gemm_ws_kernel(problem: GemmWsProblem, config: GemmWsConfig = DEFAULT) -> KernelInstance:
    """The kernel of ``problem`` as the ``gemm_ws`` family's instance."""
    check(problem, config)
    return KernelInstance(FAMILY, problem, config, entry_name(problem, config))


@register
class GemmWs(KernelFamily[GemmWsProblem, GemmWsConfig]):
    """The Hopper GEMM with a fused epilogue (module doc). No plan segment runs it: a
    FusedGemm node's CUDA twin launches it for long runs (:func:`twin_choice`)."""

    name = FAMILY
    segments = ("gemm_ws",)
    templates = (TEMPLATE,)
    config_type = GemmWsConfig
    compile_options = COMPILE_OPTIONS
    tunable = False
    untunable = "the Hopper GEMM is chosen by the CUDA twin from the run's rows"
    untunable_hint = "tune the layers' GEMM and attention segments"

    def problem(self, seg: SegmentView, ctx: PlanContext) -> GemmWsProblem:
        raise PlanError("no plan segment runs the Hopper GEMM",
                        hint="this is a stofc bug; report it")

    def space(self, problem: GemmWsProblem, profile: GpuProfile) -> Space:
        return Space(axes=(("bn", (128, 256)), ("stages", (2, 3, 4, 5, 6)),
                           ("coop", (True, False)), ("pass_cols", (64, 128))),
                     constraints=(_constraints,))

    def default(self, problem: GemmWsProblem, profile: GpuProfile) -> GemmWsConfig:
        return DEFAULT

    def spec(self, problem: GemmWsProblem, config: GemmWsConfig) -> KernelSpec:
        return KernelSpec(FAMILY, TEMPLATE, (("dtype", problem.dtype), ("act", problem.act),
                                             ("bias", problem.has_bias), ("bn", config.bn),
                                             ("stages", config.stages), ("coop", config.coop),
                                             ("pass_cols", config.pass_cols)))

    def config_of(self, spec: KernelSpec, problem: GemmWsProblem | None) -> GemmWsConfig:
        return GemmWsConfig(int(spec.param("bn")), int(spec.param("stages")),
                            bool(spec.param("coop")), int(spec.param("pass_cols")))

    def kernels(self, problem: GemmWsProblem, config: GemmWsConfig
                ) -> tuple[KernelInstance, ...]:
        return (gemm_ws_kernel(problem, config),)

    def render(self, kernel: KernelInstance) -> Source:
        return render_gemm_ws(kernel.problem, kernel.config)

    def nvrtc_target(self, kernel: KernelInstance, target: str) -> str:
        if target in ("sm_90", "compute_90"):      # wgmma, setmaxnreg: sm_90a only
            return f"{target}a"
        return target


def check_shape(m: int, n: int, k: int) -> None:
    """PlanError unless the kernel takes these extents: the TMA needs 16-byte row strides
    (K and N multiples of 8) and the epilogue stores 16-byte pieces of a row."""
    if min(m, n, k) <= 0 or k % 8 or n % 8:
        raise PlanError(f"the Hopper GEMM needs K and N multiples of 8 (M={m}, N={n}, K={k})",
                        hint="use the cuBLASLt path for this node")
