"""Block-wise attention (family ``attention_block``): tensor cores on whole mask tiles.

Templates ``attention/block.cu.j2`` (mma.sync m16n8k16, every GPU from sm_80) and
``attention/block_wgmma.cu.j2`` (Hopper warpgroup MMA, compiled for ``sm_90a``: a
warpgroup of 4 warps owns 64 rows, Q/K/V sit in 128B-swizzled shared memory, head_dim
64 or 128); the config's ``mma`` picks one. A block owns ``T / q_split`` query rows of
one tile row and walks that row's outer tiles (maybe gathered, :mod:`.gather`, or
residue-permuted, :mod:`.permute`) through a ``stages``-deep cp.async ring of K/V tiles.

Cost model (the selector's, :meth:`AttentionBlock.estimate_us`): every loaded outer
tile costs ``4 T^2 D`` tensor-core flops (the mask's zeros inside part tiles are
computed and thrown away) at ``BLOCK_EFFICIENCY`` of the fp16 peak (masked tiles
``MASKED_TILE_COST`` x); the grid runs in waves of ``sm_count * blocks_per_sm`` blocks
(wave quantisation), and the longest tile row bounds the time from below (BigBird's
dense global rows). Calibrated on an H200 (bench/results/mha-h200-2026-11-22.json, 12
mask x length cases; estimates within 0.8-1.15x of the measured selector configs).

Run-time variants (:meth:`AttentionBlock.runtime_variants`): the base kernel is the
unsplit config (right once the grid fills the GPU); when the query split can pay on
this GPU, a split variant takes the runs with ``B * ceil(S/T) <=`` :func:`split_limit`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np

from stofc.errors import StofcError
from stofc.kernels.attention.config import (
    ELEM_BYTES,
    REG_LIMIT,
    REG_OVERHEAD,
    AttentionConfig,
    ExtraInputs,
    estimate_registers,
    prune,
    q_in_registers,
    resource_reason,
    smem_bytes,
)
from stofc.kernels.attention.family import AttentionFamily, AttentionProblem
from stofc.kernels.attention.gather import TilePlan, plan_tiles
from stofc.kernels.attention.launch import Walk
from stofc.kernels.attention.permute import choose_permutation, permuted_plan
from stofc.kernels.attention.select import AttentionVariant, KernelChoice
from stofc.kernels.registry import register
from stofc.masks.format import MaskFormat
from stofc.targets import GpuProfile

MMAS: tuple[str, ...] = ("sync", "wgmma")
WGMMA_CC = (9, 0)        # wgmma is sm_90a only: H100 / H200 (not forward compatible)
WGMMA_HEAD_DIMS = (64, 128, 256)   # whole 128-byte swizzle panels
SMEM_ALIGN_SLACK = 1024  # wgmma: the kernel aligns its swizzle panels to 1024 bytes
MIN_REG_CAP = 96         # below this, __launch_bounds__ caps force heavy spills
BLOCK_EFFICIENCY = 0.25   # ~250 TFLOP/s on full walked tiles (mma.sync, FA2 class)
MASKED_TILE_COST = 1.45   # a part / gathered tile costs 1.45 full ones (bitmap tests, keys)
BLOCK_LATENCY_US = 3.0    # per wave: Q load + first tile before the first MMA


def kernel_target(mma: str, target: str) -> str:
    """The NVRTC target a kernel using ``mma`` compiles for, given the GPU's target.

    wgmma exists only on the arch-specific ``sm_90a`` / ``compute_90a``; mma.sync
    kernels compile for ``target`` as given.
    """
    if mma == "wgmma" and target in ("sm_90", "compute_90"):
        return f"{target}a"
    return target


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


def blocks_per_sm(cfg: AttentionConfig, head_dim: int, profile: GpuProfile) -> int:
    """Resident blocks of ``cfg`` per SM (registers, warps, shared memory, the SM's limit)."""
    per_thread = estimate_registers(cfg, head_dim)
    if cfg.min_blocks > 1:
        per_thread = min(per_thread, profile.regs_per_sm // (cfg.min_blocks * cfg.threads))
    regs = per_thread * cfg.threads
    by_regs = profile.regs_per_sm // max(regs, 1)
    by_warps = profile.max_warps_per_sm // cfg.warps
    by_smem = profile.smem_per_sm // max(smem_bytes(cfg, head_dim), 1)
    return max(1, min(by_regs, by_warps, by_smem, profile.max_blocks_per_sm))


def _split_slots(fmt: MaskFormat, profile: GpuProfile, head_dim: int) -> int | None:
    """Resident blocks of the unsplit 2-stage config on the whole GPU (None: it does not fit)."""
    base = AttentionConfig("block", fmt.tile, 16, fmt.tile // 16, 2, 1)
    if prune(base, head_dim, profile) is not None:
        return None
    return profile.sm_count * blocks_per_sm(base, head_dim, profile)


def split_limit(fmt: MaskFormat, profile: GpuProfile, *, heads: int, head_dim: int) -> int:
    """Largest ``batch * tile_rows`` for which the query split pays (0: never).

    :func:`block_config`'s rule, stated for a run: split while the unsplit grid
    ``batch * heads * rows`` is short of one wave of resident blocks. The package's
    SparseAttention node applies it at run time with the actual batch and length
    (``variant_max_batch_rows``, OPS.md), so one package serves B=1 and B=16 alike.
    """
    slots = _split_slots(fmt, profile, head_dim)
    return 0 if slots is None else max(0, math.ceil(slots / heads) - 1)


def block_config(fmt: MaskFormat, profile: GpuProfile, *, batch: int, heads: int,
                 head_dim: int, q_split: int | None = None) -> AttentionConfig | None:
    """Starting block-wise config (None when the search space is empty, e.g. T=128, D=128).

    Measured on an H200 (bench/results): 64 query rows x 4 warps x 2 stages is best or
    within 5% on every family at L=1024 and 4096; on Hopper the best wgmma config is
    1.13-1.33x faster than the best mma.sync one on every family and length, and the
    64-row 4-warp one is the best or within 11% (mha-h100-2026-11-22-wgmma.md), so it
    comes first wherever :func:`~.config.prune` allows it
    (sm_90, head_dim 64/128, 64-row warpgroups: not with the T=64 query split,
    which falls back to mma.sync); the query split only pays when the
    grid is short of one wave (:func:`split_limit`; ``q_split`` forces it); the
    __launch_bounds__ occupancy cap is taken when it keeps >= 128 registers per thread;
    gathering whenever the plan gathers anything.
    """
    t = fmt.tile
    rows = fmt.tile_rows
    gather = plan_tiles(fmt, gather=True).gathered > 0
    permute = choose_permutation(fmt) is not None
    if _split_slots(fmt, profile, head_dim) is None:
        return None
    if q_split is None:
        q_split = 2 if batch * rows <= split_limit(fmt, profile, heads=heads,
                                                   head_dim=head_dim) else 1
    warps = t // q_split // 16
    for mma in ("wgmma", "sync"):
        for stages in (2, 3):
            mb = occupancy_blocks(t, warps, stages, q_split, head_dim, profile, mma)
            for cfg in (AttentionConfig("block", t, 16, warps, stages, q_split, gather, mb,
                                        permute, mma),
                        AttentionConfig("block", t, 16, warps, stages, q_split, gather, 1,
                                        permute, mma)):
                if prune(cfg, head_dim, profile) is None:
                    return cfg
    return None


def weighted_tiles_per_row(plan: TilePlan, rows: int) -> np.ndarray:
    """Tiles per (format head, tile row), masked tiles counted MASKED_TILE_COST times."""
    masked = ((plan.part_idx >= 0) | (plan.key_base < 0)).astype(np.float64)
    csum = np.concatenate([[0.0], np.cumsum(masked)])
    ptr = plan.row_ptr.astype(np.int64)
    n_masked = csum[ptr[:, 1:rows + 1]] - csum[ptr[:, :rows]]
    n_all = (ptr[:, 1:rows + 1] - ptr[:, :rows]).astype(np.float64)
    return n_all + (MASKED_TILE_COST - 1.0) * n_masked


@register
class AttentionBlock(AttentionFamily):
    """Block-wise attention, mma.sync and wgmma forms (see the module doc)."""

    name = "attention_block"
    kind = "block"
    label = "block-wise"
    stof_class = "block"
    plan_code = 0
    templates = ("attention/block.cu.j2", "attention/block_wgmma.cu.j2")
    preference = 0
    space_order = 0
    tuner_tag = (("kind", "block"),)

    def template_of(self, config: AttentionConfig) -> str:
        return self.templates[1] if config.mma == "wgmma" else self.templates[0]

    def target_for(self, config: AttentionConfig, target: str) -> str:
        return kernel_target(config.mma, target)

    def rows_per_block(self, config: AttentionConfig) -> int:
        return config.tile // config.q_split

    def name_tag(self, config: AttentionConfig) -> str:
        return "_wg" if config.mma == "wgmma" else ""

    def describe(self, config: AttentionConfig) -> str:
        c = config
        return (f"block-wise T={c.tile} rows/block={c.tile // c.q_split} "
                f"warps={c.warps} rows/warp={c.warp_m} stages={c.stages}"
                f"{f' minblocks={c.min_blocks}' if c.min_blocks > 1 else ''}"
                f"{' gather' if c.gather else ''}{' permute' if c.permute else ''}"
                f"{' wgmma' if c.mma == 'wgmma' else ''}")

    def smem_bytes(self, config: AttentionConfig, head_dim: int) -> int:
        if config.mma == "wgmma":           # unpadded swizzled rows + the alignment slack
            srow, slack = head_dim * ELEM_BYTES, SMEM_ALIGN_SLACK
        else:                               # padded rows: conflict-free ldmatrix
            srow, slack = (head_dim + 8) * ELEM_BYTES, 0
        q = self.rows_per_block(config) * srow
        stage = 2 * config.tile * srow + (config.tile // 8) ** 2 * 8 + config.tile * 4
        return q + config.stages * stage + slack

    def registers(self, config: AttentionConfig, head_dim: int) -> int:
        mt = config.warp_m // 16
        acc = mt * (head_dim // 8) * 4
        keys = min(config.tile, 64)               # the kernel's softmax step (KN)
        s = mt * (keys // 8) * 4
        # wgmma reads Q from smem; mma.sync keeps its fragments unless head_dim is large
        qf = (0 if config.mma == "wgmma" or not q_in_registers(head_dim)
              else mt * (head_dim // 16) * 4)
        pf = mt * (keys // 16) * 4
        return acc + s + qf + pf + REG_OVERHEAD

    def prune(self, config: AttentionConfig, head_dim: int, profile: GpuProfile) -> str | None:
        c = config
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
            if c.warp_m != 16 or self.rows_per_block(c) % 64:
                return "wgmma: a warpgroup (4 warps x 16 rows) owns 64 rows of the block"
            if head_dim not in WGMMA_HEAD_DIMS:
                return "wgmma: head_dim must be 64, 128 or 256 (whole 128-byte swizzle panels)"
        if c.min_blocks < 1 or profile.regs_per_sm // (c.min_blocks * c.threads) < MIN_REG_CAP:
            return (f"min_blocks={c.min_blocks} caps registers below {MIN_REG_CAP} per thread: "
                    "the accumulators would spill")
        if c.min_blocks * self.smem_bytes(c, head_dim) > profile.smem_per_sm:
            return f"{c.min_blocks} blocks per SM do not fit the SM's shared memory"
        return resource_reason(c, head_dim, profile)

    def search_space(self, head_dim: int, profile: GpuProfile, *, tile: int, gatherable: bool,
                     permutable: bool) -> list[AttentionConfig]:
        out: list[AttentionConfig] = []
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
        return out

    def candidates(self, problem: AttentionProblem, profile: GpuProfile
                   ) -> tuple[list[AttentionConfig], dict[str, int]]:
        if problem.fmt.tile < 64:
            return [], {f"block-wise needs T >= 64 (mask tile {problem.fmt.tile})": 1}
        return super().candidates(problem, profile)

    # -- the selector -----------------------------------------------------------------
    def starting_config(self, fmt: MaskFormat, profile: GpuProfile, *, batch: int, heads: int,
                        seq_len: int, head_dim: int, extras: ExtraInputs
                        ) -> AttentionConfig | None:
        return block_config(fmt, profile, batch=batch, heads=heads, head_dim=head_dim)

    def unavailable(self, fmt: MaskFormat, head_dim: int) -> str:
        if fmt.tile < 64:
            return f"the mask's tile T={fmt.tile} is below the block-wise minimum of 64"
        return (f"no block-wise config fits T={fmt.tile} with head_dim={head_dim} "
                "(registers or shared memory)")

    def estimate_us(self, fmt: MaskFormat, profile: GpuProfile, config: AttentionConfig, *,
                    batch: int, heads: int, seq_len: int, head_dim: int) -> float:
        t = fmt.tile
        rows = math.ceil(seq_len / t)
        hf = heads if fmt.num_heads == 1 else 1          # heads per format head
        brows = rows
        if config.permute and (chosen := choose_permutation(fmt)) is not None:
            plan = permuted_plan(chosen[2], chosen[1], gather=config.gather)
            brows = fmt.tile_rows                          # permuted rows mix all positions
        else:
            plan = plan_tiles(fmt, gather=config.gather)
        tiles_per_row = weighted_tiles_per_row(plan, brows)
        tiles = tiles_per_row.sum() * batch * hf
        tile_flops = 4.0 * t * t * head_dim
        rate = BLOCK_EFFICIENCY * profile.fp16_tflops * 1e12
        blocks = batch * heads * brows * config.q_split
        slots = profile.sm_count * blocks_per_sm(config, head_dim, profile)
        waves = math.ceil(blocks / slots)
        quant = waves / (blocks / slots)
        per_block_rate = rate / slots
        longest = (tiles_per_row.max() * tile_flops / config.q_split / per_block_rate
                   if brows else 0.0)
        block_us = max(tiles * tile_flops / rate * min(quant, 2.0), longest) * 1e6
        return float(block_us + waves * BLOCK_LATENCY_US)

    def advantage(self, fmt: MaskFormat) -> str:
        return (f"tensor cores on {fmt.tile}x{fmt.tile} tiles beat per-element K/V "
                "re-reads")

    def runtime_variants(self, choice: KernelChoice, fmt: MaskFormat, profile: GpuProfile, *,
                         batch: int, heads: int, head_dim: int
                         ) -> tuple[KernelChoice, tuple[AttentionVariant, ...]]:
        """The unsplit config as the base and, when the split can pay, the split variant
        (see the module doc)."""
        limit = split_limit(fmt, profile, heads=heads, head_dim=head_dim)
        whole = block_config(fmt, profile, batch=batch, heads=heads, head_dim=head_dim,
                             q_split=1)
        split = block_config(fmt, profile, batch=batch, heads=heads, head_dim=head_dim,
                             q_split=2)
        if limit <= 0 or whole is None or split is None:
            return choice, ()
        why = (f"query split while batch x tile rows <= {limit} (the grid is short of one "
               f"wave of {profile.sm_count}-SM resident blocks at {heads} heads)")
        said = choice.explanation.replace(choice.config.describe(), whole.describe())
        base = replace(choice, config=whole,
                       explanation=f"{said}; at run time: {why}, with the split variant "
                                   f"({split.describe()})")
        return base, (AttentionVariant(0, limit, replace(choice, config=split), why),)

    # -- launch -----------------------------------------------------------------------
    def blocks_per_tile_row(self, config: AttentionConfig) -> int:
        return config.q_split

    def walk(self, fmt: MaskFormat, config: AttentionConfig) -> Walk:
        """The walk list, maybe gathered; residue-permuted rows and keys when asked."""
        perm = None
        if config.permute:
            chosen = choose_permutation(fmt)
            if chosen is None:
                raise StofcError("the attention config asks for a residue permutation but none "
                                 "pays for this mask", hint="use permute=False")
            _, perm, pfmt = chosen
            plan = permuted_plan(pfmt, perm, gather=config.gather)
        else:
            plan = plan_tiles(fmt, gather=config.gather)
        return Walk(plan.row_ptr, plan.key_base, plan.part_idx, plan.bitmaps, plan.gather_keys,
                    plan.tiles_per_row, plan=plan, permutation=perm)

    def launch_key(self, config: AttentionConfig) -> str:
        return (f"{self.kind}{'-gather' if config.gather else ''}"
                f"{'-permute' if config.permute else ''}")
