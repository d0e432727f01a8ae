"""What every attention kernel family shares: the config, the rendered-kernel spec, checks.

A :class:`AttentionConfig` is everything the Python side decides about a kernel's
shape; together with the data type, head_dim and the two template flags it forms
a :class:`KernelSpec`, which renders to exactly one CUDA source. ``kind`` names the
family whose config it is (``block``: :mod:`.block`, ``row``: :mod:`.row`); what the
fields mean, which values are valid and why others are pruned is that family's
(:func:`attention_family`). The functions here that depend on the kind
(:func:`prune`, :func:`smem_bytes`, :func:`estimate_registers`, :func:`search_space`,
:func:`template_name`) ask the family; the rest is shared:

Block-wise (``kind="block"``): the key tile equals the mask's outer tile ``T``
(64 or 128); a block owns ``T / q_split`` query rows of one tile row; each warp
owns ``warp_m`` (16 or 32) of them, so ``warps = T / q_split / warp_m``;
``stages`` (2..4) is the depth of the cp.async ring of K/V tiles; ``mma`` is the
tensor-core instruction: ``"sync"`` (mma.sync m16n8k16, every GPU from sm_80) or
``"wgmma"`` (Hopper warpgroup MMA, compiled for ``sm_90a``).

Row-wise (``kind="row"``): a warp owns ``warp_m`` (1, 2 or 4) query rows, a
block ``warps * warp_m`` consecutive rows inside one tile row; ``stages`` and
``q_split`` are 1 (unused).

Warp-specialised (``kind="ws"``, Hopper, :mod:`.ws`): a producer warpgroup streams
K/V with the Tensor Memory Accelerator into a ``stages``-deep ring, two consumer
warpgroups own 64 query rows each (two tile rows of T=64); ``pingpong`` makes the
consumers alternate their GEMMs; ``split`` cuts walks longer than that many tiles
into chunks merged by a combine kernel (0: no split), ``split_rows`` > 0 only the longest
``split_rows`` of them per head (a tail split that fills the last wave of a launch of
equal rows); ``period`` > 1 walks a dilated
mask's residues apart (:mod:`.residue`); ``lean_walk`` says the plan's every entry is a
full tile of each warpgroup with no shared chunk (:func:`.ws_plan.lean_walk`), so the kernel
reads no walk entries (set from the mask's plan, checked against it at launch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from stofc.errors import StofcError
from stofc.kernels.registry import families_for
from stofc.targets import GpuProfile

if TYPE_CHECKING:
    from stofc.kernels.attention.family import AttentionFamily

HEAD_DIMS: tuple[int, ...] = (32, 64, 80, 96, 128, 256)
DTYPES: dict[str, str] = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
TILES: tuple[int, ...] = (16, 32, 64, 128)   # the mask format's outer tiles
ELEM_BYTES = 2
REG_LIMIT = 255          # registers per thread the hardware allows
REG_OVERHEAD = 64        # addresses, loop state, masks (ptxas -v on sm_90: 137 regs for T=64,D=64)
Q_REG_HEAD_DIM = 128     # larger head_dims re-read Q from smem: the O accumulators need the registers


@dataclass(frozen=True)
class AttentionConfig:
    """One point of a kernel's search space (see the module docstring)."""

    kind: str
    tile: int
    warp_m: int
    warps: int
    stages: int = 1
    q_split: int = 1
    gather: bool = False   # block-wise: pack sparse-column part tiles (runtime data only)
    min_blocks: int = 1    # block-wise: __launch_bounds__ min blocks/SM (caps registers)
    permute: bool = False  # block-wise: residue permutation of queries and keys (runtime data)
    mma: str = "sync"      # block-wise: "sync" (mma.sync) or "wgmma" (sm_90a warpgroup MMA)
    split: int = 0         # ws: walks longer than this many tiles are split (0: never)
    split_rows: int = 0    # ws: at most this many pair rows per head are split (0: all)
    pingpong: bool = True  # ws: the two consumer warpgroups alternate their GEMMs
    kstep: int = 1         # ws: 64-key tiles per softmax step (1 or 2)
    period: int = 1        # ws: residue split of a dilated mask (1: none; .residue)
    lean_walk: bool = False  # ws: every walk entry a full tile of each warpgroup (ws_plan.lean_walk)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def rows_per_block(self) -> int:
        """Query rows one thread block owns."""
        return attention_family(self.kind).rows_per_block(self)

    def describe(self) -> str:
        return attention_family(self.kind).describe(self)


@dataclass(frozen=True)
class ExtraInputs:
    """What a layer's SparseAttention node reads besides Q, K and V, as the selector sees
    it: ``has_bias`` (an additive score bias), ``has_key_bits`` (a key padding mask),
    ``has_softcap`` (the scores are soft-capped). Each adds code to the kernel, so it can
    change which config runs without spilling (:func:`.ws_cost.ws_spills`); the selector's
    memo keys hold it."""

    has_bias: bool = False
    has_key_bits: bool = False
    has_softcap: bool = False


NO_EXTRAS = ExtraInputs()     # Q, K and V only: what a caller that says nothing gets


@dataclass(frozen=True)
class KernelSpec:
    """A config plus what the template needs to render one source."""

    config: AttentionConfig
    dtype: str            # "float16" | "bfloat16"
    head_dim: int
    has_bias: bool = False
    has_key_bits: bool = False
    has_softcap: bool = False   # logit soft-capping (the value is a launch argument)

    @property
    def name(self) -> str:
        """The kernel's entry name; the ORT library parses its tail ``[_c]_b?_k?``."""
        c = self.config
        dt = "f16" if self.dtype == "float16" else "bf16"
        return (f"stofc_attn_{c.kind}_{dt}_d{self.head_dim}_t{c.tile}_w{c.warps}_m{c.warp_m}"
                f"_s{c.stages}_q{c.q_split}_o{c.min_blocks}"
                f"{attention_family(c.kind).name_tag(c)}{'_c' if self.has_softcap else ''}"
                f"_b{int(self.has_bias)}_k{int(self.has_key_bits)}")

    @property
    def q_in_regs(self) -> bool:
        """Whether the kernel keeps Q (block-wise: its fragments; row-wise: the row) in
        registers; above ``Q_REG_HEAD_DIM`` it re-reads Q from shared memory."""
        return q_in_registers(self.head_dim)

    @property
    def template(self) -> str:
        """The template that renders this spec."""
        return attention_family(self.config.kind).template_of(self.config)


def attention_families() -> tuple[AttentionFamily, ...]:
    """The registered attention families, by preference (the selector's order)."""
    return cast("tuple[AttentionFamily, ...]", families_for("attention"))


def attention_family(kind: str) -> AttentionFamily:
    """The attention family whose configs have ``kind``; StofcError for an unknown kind."""
    for fam in attention_families():
        if fam.kind == kind:
            return fam
    kinds = ", ".join(repr(f.kind) for f in attention_families())
    raise StofcError(f"unknown attention kernel {kind!r}", hint=f"use one of {kinds}")


def template_name(kind: str, mma: str = "sync") -> str:
    """The attention template of a kernel kind and MMA instruction."""
    fam = attention_family(kind)
    return fam.template_of(AttentionConfig(kind, 64, 16, 4, mma=mma))


def q_in_registers(head_dim: int) -> bool:
    """Whether a kernel of this head_dim keeps Q in registers (see ``KernelSpec.q_in_regs``)."""
    return head_dim <= Q_REG_HEAD_DIM


def check_head_dim(head_dim: int) -> None:
    """Raise a StofcError for a head_dim the kernels do not implement."""
    if head_dim not in HEAD_DIMS:
        raise StofcError(f"attention head_dim {head_dim} is not supported",
                         hint=f"use a model whose head_dim is one of {', '.join(map(str, HEAD_DIMS))}")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise StofcError(f"attention dtype {dtype!r} is not supported",
                         hint="use float16 or bfloat16")


def smem_bytes(config: AttentionConfig, head_dim: int) -> int:
    """Shared memory one block needs (dynamic for block-wise, static for row-wise)."""
    return attention_family(config.kind).smem_bytes(config, head_dim)


def estimate_registers(config: AttentionConfig, head_dim: int) -> int:
    """Registers per thread the kernel's live arrays need (accumulators, S, Q, P)."""
    return attention_family(config.kind).registers(config, head_dim)


def prune(config: AttentionConfig, head_dim: int, profile: GpuProfile) -> str | None:
    """Why ``config`` cannot run (or cannot run well) on ``profile``; None if it is valid:
    a known kind and mask tile, then its family's rules."""
    c = config
    kinds = [f.kind for f in attention_families()]
    if c.kind not in kinds:
        return f"unknown kernel kind {c.kind!r}"
    if c.tile not in TILES:
        return f"tile {c.tile} is not a mask-format tile size"
    fam = attention_family(c.kind)
    if c.period != 1 and not fam.residue_split:
        return f"{fam.label}: no residue split (period {c.period}); only the warp-specialised kernel has one"
    return fam.prune(c, head_dim, profile)


def resource_reason(config: AttentionConfig, head_dim: int, profile: GpuProfile) -> str | None:
    """What every kernel of one block of ``config.threads`` threads obeys: the block's shared
    memory and registers (the estimate is +-10%: 256 compiled to 234-255); None if it fits."""
    c = config
    smem = smem_bytes(c, head_dim)
    if smem > profile.smem_per_block:
        return f"needs {smem} B of shared memory, the GPU allows {profile.smem_per_block} per block"
    regs = estimate_registers(c, head_dim)
    if c.min_blocks > 1:                       # the cap replaces the estimate (ptxas obeys it)
        regs = min(regs, profile.regs_per_sm // (c.min_blocks * c.threads))
    if regs > REG_LIMIT + 1:
        return f"needs about {regs} registers per thread (> {REG_LIMIT}): would spill"
    if regs * c.threads > profile.regs_per_sm:
        return "the block's registers exceed one SM's register file"
    return None


def search_space(kind: str, head_dim: int, dtype: str, profile: GpuProfile, *,
                 tile: int = 64, gatherable: bool = True,
                 permutable: bool = False) -> list[AttentionConfig]:
    """Every valid config of ``kind`` for a format with outer tile ``tile``.

    ``gatherable`` / ``permutable`` say whether the format's walk list changes with
    gathering (``plan_tiles(fmt).gathered > 0``) or a residue permutation
    (``choose_permutation(fmt) is not None``); without them those switches would only
    duplicate configs. Each candidate that :func:`prune` rejects is dropped.
    """
    check_head_dim(head_dim)
    check_dtype(dtype)
    fam: Any = attention_family(kind)
    return list(fam.search_space(head_dim, profile, tile=tile, gatherable=gatherable,
                                 permutable=permutable))
