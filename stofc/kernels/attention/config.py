"""Configurations of the two attention kernels, their search spaces and why they prune.

A :class:`AttentionConfig` is everything the Python side decides about a kernel's
shape; together with the data type, head_dim and the two template flags it forms
a :class:`KernelSpec`, which renders to exactly one CUDA source.

Block-wise (``kind="block"``): the key tile equals the mask's outer tile ``T``
(64 or 128); a block owns ``T / q_split`` query rows of one tile row; each warp
owns ``warp_m`` (16 or 32) of them, so ``warps = T / q_split / warp_m``;
``stages`` (2..4) is the depth of the cp.async ring of K/V tiles; ``mma`` is the
tensor-core instruction: ``"sync"`` (mma.sync m16n8k16, every GPU from sm_80) or
``"wgmma"`` (Hopper warpgroup MMA, compiled for ``sm_90a``: a warpgroup of 4 warps
owns 64 rows, Q/K/V sit in 128B-swizzled shared memory, head_dim 64 or 128).

Row-wise (``kind="row"``): a warp owns ``warp_m`` (1, 2 or 4) query rows, a
block ``warps * warp_m`` consecutive rows inside one tile row; ``stages`` and
``q_split`` are 1 (unused).

Warp-specialised (``kind="ws"``, Hopper, :mod:`.ws`): a producer warpgroup streams
K/V with the Tensor Memory Accelerator into a ``stages``-deep ring, two consumer
warpgroups own 64 query rows each (two tile rows of T=64); ``pingpong`` makes the
consumers alternate their GEMMs; ``split`` cuts walks longer than that many tiles
into chunks merged by a combine kernel (0: no split).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from stofc.errors import StofcError
from stofc.kernels.attention.ws import (
    KSTEPS,
    SPLITS,
    WS_STAGES,
    WS_TILE,
    WS_WARPS,
    ws_prune,
    ws_registers,
    ws_smem_bytes,
)
from stofc.targets import GpuProfile

HEAD_DIMS: tuple[int, ...] = (32, 64, 80, 96, 128, 256)
DTYPES: dict[str, str] = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
KINDS: tuple[str, ...] = ("block", "row", "ws")
MMAS: tuple[str, ...] = ("sync", "wgmma")
WGMMA_CC = (9, 0)        # wgmma is sm_90a only: H100 / H200 (not forward compatible)
WGMMA_HEAD_DIMS = (64, 128, 256)   # whole 128-byte swizzle panels
SMEM_ALIGN_SLACK = 1024  # wgmma: the kernel aligns its swizzle panels to 1024 bytes
ELEM_BYTES = 2
REG_LIMIT = 255          # registers per thread the hardware allows
MIN_REG_CAP = 96         # below this, __launch_bounds__ caps force heavy spills
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
    pingpong: bool = True  # ws: the two consumer warpgroups alternate their GEMMs
    kstep: int = 1         # ws: 64-key tiles per softmax step (1 or 2)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def rows_per_block(self) -> int:
        """Query rows one thread block owns."""
        if self.kind == "block":
            return self.tile // self.q_split
        if self.kind == "ws":
            return 2 * self.tile
        return self.warps * self.warp_m

    def describe(self) -> str:
        if self.kind == "block":
            return (f"block-wise T={self.tile} rows/block={self.rows_per_block} "
                    f"warps={self.warps} rows/warp={self.warp_m} stages={self.stages}"
                    f"{f' minblocks={self.min_blocks}' if self.min_blocks > 1 else ''}"
                    f"{' gather' if self.gather else ''}{' permute' if self.permute else ''}"
                    f"{' wgmma' if self.mma == 'wgmma' else ''}")
        if self.kind == "ws":
            return (f"warp-specialised T={self.tile} rows/block=128 stages={self.stages}"
                    f" keys/step={64 * self.kstep}{' pingpong' if self.pingpong else ''}"
                    f"{f' split={self.split}' if self.split else ''}")
        return f"row-wise T={self.tile} warps={self.warps} rows/warp={self.warp_m}"


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
                f"{'_wg' if c.mma == 'wgmma' and c.kind != 'ws' else ''}"
                f"{'_pp' if c.kind == 'ws' and c.pingpong else ''}"
                f"{'_k2' if c.kind == 'ws' and c.kstep == 2 else ''}"
                f"{'_c' if self.has_softcap else ''}"
                f"_b{int(self.has_bias)}_k{int(self.has_key_bits)}")

    @property
    def q_in_regs(self) -> bool:
        """Whether the kernel keeps Q (block-wise: its fragments; row-wise: the row) in
        registers; above ``Q_REG_HEAD_DIM`` it re-reads Q from shared memory."""
        return q_in_registers(self.head_dim)

    @property
    def template(self) -> str:
        """The template that renders this spec."""
        return template_name(self.config.kind, self.config.mma)


def q_in_registers(head_dim: int) -> bool:
    """Whether a kernel of this head_dim keeps Q in registers (see ``KernelSpec.q_in_regs``)."""
    return head_dim <= Q_REG_HEAD_DIM


def template_name(kind: str, mma: str = "sync") -> str:
    """The attention template of a kernel kind and MMA instruction."""
    if kind == "ws":
        return "attention/block_ws.cu.j2"
    return "attention/block_wgmma.cu.j2" if mma == "wgmma" else f"attention/{kind}.cu.j2"


def kernel_target(mma: str, target: str) -> str:
    """The NVRTC target a kernel using ``mma`` compiles for, given the GPU's target.

    wgmma exists only on the arch-specific ``sm_90a`` / ``compute_90a``; mma.sync
    kernels compile for ``target`` as given.
    """
    if mma == "wgmma" and target in ("sm_90", "compute_90"):
        return f"{target}a"
    return target


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
    if config.kind == "row":
        q_row = 0 if q_in_registers(head_dim) else config.warps * head_dim * 4
        return config.warps * 64 * 4 + q_row
    if config.kind == "ws":
        return ws_smem_bytes(config.stages, head_dim)
    if config.mma == "wgmma":           # unpadded swizzled rows + the alignment slack
        srow, slack = head_dim * ELEM_BYTES, SMEM_ALIGN_SLACK
    else:                               # padded rows: conflict-free ldmatrix
        srow, slack = (head_dim + 8) * ELEM_BYTES, 0
    q = config.rows_per_block * srow
    stage = 2 * config.tile * srow + (config.tile // 8) ** 2 * 8 + config.tile * 4
    return q + config.stages * stage + slack


def estimate_registers(config: AttentionConfig, head_dim: int) -> int:
    """Registers per thread the kernel's live arrays need (accumulators, S, Q, P)."""
    if config.kind == "row":
        q = head_dim if q_in_registers(head_dim) else 0
        return q + 2 * ((head_dim // 2 + 31) // 32) + 16 + REG_OVERHEAD // 2
    if config.kind == "ws":
        return ws_registers(head_dim)
    mt = config.warp_m // 16
    acc = mt * (head_dim // 8) * 4
    keys = min(config.tile, 64)               # the kernel's softmax step (KN)
    s = mt * (keys // 8) * 4
    # wgmma reads Q from smem; mma.sync keeps its fragments unless head_dim is large
    qf = 0 if config.mma == "wgmma" or not q_in_registers(head_dim) else mt * (head_dim // 16) * 4
    pf = mt * (keys // 16) * 4
    return acc + s + qf + pf + REG_OVERHEAD


def prune(config: AttentionConfig, head_dim: int, profile: GpuProfile) -> str | None:
    """Why ``config`` cannot run (or cannot run well) on ``profile``; None if it is valid."""
    c = config
    if c.kind not in KINDS:
        return f"unknown kernel kind {c.kind!r}"
    if c.tile not in (16, 32, 64, 128):
        return f"tile {c.tile} is not a mask-format tile size"
    if c.kind == "ws":
        return ws_prune(c, head_dim, profile)
    if c.kind == "block":
        if c.tile < 64:
            return "block-wise needs T >= 64: smaller key tiles starve the tensor cores"
        if c.warp_m not in (16, 32):
            return "block-wise warps own 16 or 32 rows (one or two m16 MMA tiles)"
        if c.q_split not in (1, 2) or c.tile % (c.q_split * c.warp_m):
            return "rows per block must be T or T/2 and a multiple of rows per warp"
        if c.warps != c.tile // c.q_split // c.warp_m:
            return "warps must equal rows per block / rows per warp"
        if not 2 <= c.stages <= 4:
            return "stages must be 2..4 (1 has no overlap, more only adds smem)"
        if c.mma not in MMAS:
            return f"unknown MMA instruction {c.mma!r}"
        if c.mma == "wgmma":
            if profile.compute_capability != WGMMA_CC:
                return "wgmma is Hopper-only (sm_90a): this GPU runs mma.sync"
            if c.warp_m != 16 or c.rows_per_block % 64:
                return "wgmma: a warpgroup (4 warps x 16 rows) owns 64 rows of the block"
            if head_dim not in WGMMA_HEAD_DIMS:
                return "wgmma: head_dim must be 64, 128 or 256 (whole 128-byte swizzle panels)"
        if c.min_blocks < 1 or profile.regs_per_sm // (c.min_blocks * c.threads) < MIN_REG_CAP:
            return (f"min_blocks={c.min_blocks} caps registers below {MIN_REG_CAP} per thread: "
                    "the accumulators would spill")
        if c.min_blocks * smem_bytes(c, head_dim) > profile.smem_per_sm:
            return f"{c.min_blocks} blocks per SM do not fit the SM's shared memory"
    else:
        if c.warp_m not in (1, 2, 4) or c.warps not in (1, 2, 4, 8):
            return "row-wise: 1, 2 or 4 rows per warp and 1..8 warps"
        if c.tile % c.rows_per_block:
            return "row-wise: a block's rows must lie inside one tile row (T % rows == 0)"
        if (c.stages != 1 or c.q_split != 1 or c.gather or c.permute or c.min_blocks != 1
                or c.mma != "sync"):
            return "row-wise has no pipeline stages, query split, gathered tiles or wgmma"
    smem = smem_bytes(c, head_dim)
    if smem > profile.smem_per_block:
        return f"needs {smem} B of shared memory, the GPU allows {profile.smem_per_block} per block"
    regs = estimate_registers(c, head_dim)
    if c.min_blocks > 1:                       # the cap replaces the estimate (ptxas obeys it)
        regs = min(regs, profile.regs_per_sm // (c.min_blocks * c.threads))
    if regs > REG_LIMIT + 1:                   # estimate is +-10%: 256 compiled to 234-255
        return f"needs about {regs} registers per thread (> {REG_LIMIT}): would spill"
    if regs * c.threads > profile.regs_per_sm:
        return "the block's registers exceed one SM's register file"
    return None


def occupancy_blocks(tile: int, warps: int, stages: int, q_split: int, head_dim: int,
                     profile: GpuProfile, mma: str = "sync") -> int:
    """Blocks/SM that shared memory allows while registers stay >= 128/thread (or 1).

    The register cap that ``__launch_bounds__(threads, n)`` implies is what lifts
    occupancy for the 4-warp 64x64 kernel (ptxas: 164 -> 128 registers, 8 B spill).
    """
    probe = AttentionConfig("block", tile, 16, warps, stages, q_split, mma=mma)
    by_smem = profile.smem_per_sm // max(smem_bytes(probe, head_dim), 1)
    by_regs = profile.regs_per_sm // (warps * 32 * 128)
    n = min(by_smem, by_regs, profile.max_warps_per_sm // warps)
    cap = profile.regs_per_sm // max(n * warps * 32, 1)
    return n if n >= 2 and cap < REG_LIMIT else 1          # 1: the cap would change nothing


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
    out: list[AttentionConfig] = []
    if kind == "block":
        for q_split in (1, 2):
            for warp_m in (16, 32):
                if tile % (q_split * warp_m):
                    continue
                warps = tile // q_split // warp_m
                for stages, mma in itertools.product((2, 3, 4), MMAS):
                    for gather, permute in ((False, False), (True, False), (False, True),
                                            (True, True)):
                        if (gather and not gatherable) or (permute and not permutable):
                            continue
                        for mb in (1, occupancy_blocks(tile, warps, stages, q_split, head_dim,
                                                       profile, mma)):
                            cfg = AttentionConfig("block", tile, warp_m, warps, stages, q_split,
                                                  gather, mb, permute, mma)
                            if prune(cfg, head_dim, profile) is None and cfg not in out:
                                out.append(cfg)
    elif kind == "ws":
        if tile == WS_TILE:
            for stages, pingpong, split, kstep in itertools.product(WS_STAGES, (True, False),
                                                                    SPLITS, KSTEPS):
                cfg = AttentionConfig("ws", WS_TILE, 16, WS_WARPS, stages, 1, mma="wgmma",
                                      split=split, pingpong=pingpong, kstep=kstep)
                if prune(cfg, head_dim, profile) is None:
                    out.append(cfg)
    elif kind == "row":
        for warps in (1, 2, 4, 8):
            for warp_m in (1, 2, 4):
                cfg = AttentionConfig("row", tile, warp_m, warps)
                if prune(cfg, head_dim, profile) is None:
                    out.append(cfg)
    else:
        raise StofcError(f"unknown attention kernel {kind!r}", hint="use 'block', 'row' or 'ws'")
    return out
