"""The kernel selector: STOF's density formula, refined by a cost model of the GPU.

STOF (design/STOF.md): with ``n = ceil(L/16)`` and ``nnz16`` the non-empty 16x16
blocks, ``threshold = nnz16 / n^2 - 1.2 / (log2 n)^2``; row-wise when negative.
That formula ignores the GPU and the batch. stofc also estimates each kernel's
time from the profile and picks the cheaper one:

* block-wise: every loaded outer tile costs ``4 T^2 D`` tensor-core flops (the
  mask's zeros inside part tiles are computed and thrown away) at
  ``BLOCK_EFFICIENCY`` of the fp16 peak (masked tiles ``MASKED_TILE_COST`` x);
  the grid runs in waves of
  ``sm_count * blocks_per_sm`` blocks (wave quantisation), and the longest tile
  row bounds the time from below (BigBird's dense global rows);
* row-wise: every allowed element re-reads one K and one V row (``4 D`` bytes)
  from L1/L2 at ``ROW_BYTES_FACTOR`` x DRAM bandwidth, and every (query row,
  walked tile) pair costs a bitmap scan (``ROW_SCAN_NS_SM``); fitted on an H200
  to causal and strided at L=4096 (25.3 and 3.6 ms), checked on the other four.

Tile counts come from the block-wise walk list (:mod:`.gather`): sparse-column
part tiles are packed into gathered tiles, which is what makes block-wise win
on strided masks; a residue permutation (:mod:`.permute`) densifies dilated ones.

The cheaper estimate wins; the explanation states both numbers, STOF's verdict
and why they differ. The starting config fills the GPU (query split when the
grid is short of two waves) and uses the deepest pipeline that costs no occupancy.
The tuner refines the choice by measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from stofc.kernels.attention.config import (
    AttentionConfig,
    check_head_dim,
    estimate_registers,
    occupancy_blocks,
    prune,
    smem_bytes,
)
from stofc.kernels.attention.gather import plan_tiles
from stofc.kernels.attention.permute import choose_permutation, permuted_plan
from stofc.kernels.attention.ws_cost import ws_config, ws_estimate
from stofc.masks.format import MaskFormat
from stofc.targets import GpuProfile

TAU = 1.2                 # STOF's empirical constant
# Calibrated on an H200 (bench/results/mha-h200-2026-11-22.json, 12 mask x length cases;
# block estimates within 0.8-1.15x of the measured selector configs).
BLOCK_EFFICIENCY = 0.25   # ~250 TFLOP/s on full walked tiles (mma.sync, FA2 class)
MASKED_TILE_COST = 1.45   # a part / gathered tile costs 1.45 full ones (bitmap tests, keys)
ROW_BYTES_FACTOR = 0.91   # row-wise: 4*D bytes of K/V per allowed element at 0.91 x DRAM BW
ROW_SCAN_NS_SM = 36.0     # row-wise: ns x SMs per (query row, walked tile) bitmap scan
BLOCK_LATENCY_US = 3.0    # per wave: Q load + first tile before the first MMA
ROW_LATENCY_US = 1.5      # per wave: the first K row's latency


@dataclass(frozen=True)
class KernelChoice:
    """The selector's pick: kernel kind, starting config and why."""

    kernel: str
    config: AttentionConfig
    explanation: str
    stof_threshold: float
    block_us: float
    row_us: float
    ws_us: float = math.inf   # the warp-specialised Hopper kernel (inf where it cannot run)


def nonempty_blocks16(fmt: MaskFormat) -> float:
    """Non-empty 16x16 blocks, averaged over the format's heads."""
    t, itn = fmt.tile, fmt.tile // 8
    per_tile16 = (t // 16) ** 2
    total = 0
    n_full = int(np.asarray(fmt.load_part_idx < 0).sum())
    total += n_full * per_tile16        # edge tiles overcount a little; fine for a model
    if fmt.part_bitmaps.size:
        w = np.asarray(fmt.part_bitmaps).reshape(-1, itn, itn) != 0   # [p, ic, ir]
        w16 = w.reshape(-1, itn // 2, 2, itn // 2, 2).any(axis=(2, 4))
        total += int(w16.sum())
    return total / fmt.num_heads


def stof_threshold(fmt: MaskFormat, seq_len: int) -> float:
    """STOF's ``nnz16 / n^2 - tau / (log2 n)^2`` (negative: row-wise)."""
    n = max(2, math.ceil(seq_len / 16))
    return nonempty_blocks16(fmt) / n**2 - TAU / math.log2(n) ** 2


def _blocks_per_sm(cfg: AttentionConfig, head_dim: int, profile: GpuProfile) -> int:
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
    return profile.sm_count * _blocks_per_sm(base, head_dim, profile)


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
    comes first wherever :func:`prune` allows it
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


def row_config(fmt: MaskFormat, profile: GpuProfile, *, batch: int, heads: int,
               seq_len: int) -> AttentionConfig:
    """Starting row-wise config: 4 warps; 2 rows per warp once the grid has 8 waves."""
    t = fmt.tile
    rows_needed = batch * heads * seq_len
    warp_m = 2 if rows_needed >= 8 * 2 * 4 * profile.sm_count * 16 and t % 8 == 0 else 1
    return AttentionConfig("row", t, warp_m, 4)


def _weighted_tiles_per_row(plan, rows: int) -> np.ndarray:
    """Tiles per (format head, tile row), masked tiles counted MASKED_TILE_COST times."""
    masked = ((plan.part_idx >= 0) | (plan.key_base < 0)).astype(np.float64)
    csum = np.concatenate([[0.0], np.cumsum(masked)])
    ptr = plan.row_ptr.astype(np.int64)
    n_masked = csum[ptr[:, 1:rows + 1]] - csum[ptr[:, :rows]]
    n_all = (ptr[:, 1:rows + 1] - ptr[:, :rows]).astype(np.float64)
    return n_all + (MASKED_TILE_COST - 1.0) * n_masked


def _estimates(fmt: MaskFormat, profile: GpuProfile, *, batch: int, heads: int, seq_len: int,
               head_dim: int, bcfg: AttentionConfig) -> tuple[float, float]:
    t = fmt.tile
    rows = math.ceil(seq_len / t)
    hf = heads if fmt.num_heads == 1 else 1          # heads per format head
    brows = rows
    if bcfg.permute and (chosen := choose_permutation(fmt)) is not None:
        plan = permuted_plan(chosen[2], chosen[1], gather=bcfg.gather)
        brows = fmt.tile_rows                          # permuted rows mix all positions
    else:
        plan = plan_tiles(fmt, gather=bcfg.gather)
    tiles_per_row = _weighted_tiles_per_row(plan, brows)
    tiles = tiles_per_row.sum() * batch * hf
    tile_flops = 4.0 * t * t * head_dim
    rate = BLOCK_EFFICIENCY * profile.fp16_tflops * 1e12
    blocks = batch * heads * brows * bcfg.q_split
    slots = profile.sm_count * _blocks_per_sm(bcfg, head_dim, profile)
    waves = math.ceil(blocks / slots)
    quant = waves / (blocks / slots)
    per_block_rate = rate / slots
    longest = tiles_per_row.max() * tile_flops / bcfg.q_split / per_block_rate if brows else 0.0
    block_us = max(tiles * tile_flops / rate * min(quant, 2.0), longest) * 1e6
    block_us += waves * BLOCK_LATENCY_US
    # row-wise: per allowed element (K and V row re-reads) + per (query row, walked tile) scan
    nnz = float(np.asarray(fmt.row_nnz)[:, :rows].sum()) * batch * hf
    ptr = np.asarray(fmt.load_row_ptr, dtype=np.int64)
    row_tiles = float((ptr[:, 1:rows + 1] - ptr[:, :rows]).sum()) * t * batch * hf
    bytes_rate = ROW_BYTES_FACTOR * profile.mem_bandwidth_gbs * 1e9
    row_us = nnz * 4.0 * head_dim / bytes_rate * 1e6
    row_us += row_tiles * ROW_SCAN_NS_SM / profile.sm_count * 1e-3 + ROW_LATENCY_US
    return block_us, row_us


def select_kernel(fmt: MaskFormat, profile: GpuProfile, *, batch: int, heads: int,
                  seq_len: int, head_dim: int) -> KernelChoice:
    """Pick the kernel for this mask and shape on this GPU, with a reason: block-wise or
    row-wise by STOF's rule refined by the cost model, then the warp-specialised Hopper
    kernel where it runs and its estimate is lower."""
    check_head_dim(head_dim)
    seq_len = min(seq_len, fmt.seq_len)
    thr = stof_threshold(fmt, seq_len)
    bcfg = block_config(fmt, profile, batch=batch, heads=heads, head_dim=head_dim)
    rcfg = row_config(fmt, profile, batch=batch, heads=heads, seq_len=seq_len)
    block_us, row_us = math.inf, 0.0
    if bcfg is not None:
        block_us, row_us = _estimates(fmt, profile, batch=batch, heads=heads, seq_len=seq_len,
                                      head_dim=head_dim, bcfg=bcfg)
    stof = "row-wise" if thr < 0 else "block-wise"
    if fmt.tile < 64:
        kind, why = "row", f"the mask's tile T={fmt.tile} is below the block-wise minimum of 64"
    elif bcfg is None:
        kind, why = "row", (f"no block-wise config fits T={fmt.tile} with head_dim={head_dim} "
                            "(registers or shared memory)")
    elif row_us < block_us:
        kind = "row"
        why = (f"row-wise est. {row_us:.1f} us < block-wise {block_us:.1f} us: the allowed elements "
               f"are too scattered for {fmt.tile}x{fmt.tile} tensor-core tiles")
    else:
        kind = "block"
        why = (f"block-wise est. {block_us:.1f} us <= row-wise {row_us:.1f} us: tensor cores on "
               f"{fmt.tile}x{fmt.tile} tiles beat per-element K/V re-reads")
    agree = "agrees" if (thr < 0) == (kind == "row") else "is overruled"
    cfg = rcfg if kind == "row" or bcfg is None else bcfg
    wcfg = ws_config(fmt, profile, batch=batch, heads=heads, head_dim=head_dim)
    ws_us = math.inf
    if wcfg is not None:
        ws_us = ws_estimate(fmt, profile, wcfg, batch=batch, heads=heads, seq_len=seq_len,
                            head_dim=head_dim)
        best = min(block_us, row_us)
        if ws_us < best:
            why = (f"warp-specialised est. {ws_us:.1f} us < {kind}-wise {best:.1f} us: TMA-fed "
                   f"warpgroup MMA on the contiguous 64x64 tiles of the walk")
            kind, cfg = "ws", wcfg
            agree = "is refined"
        else:
            why += f" (warp-specialised est. {ws_us:.1f} us)"
    label = "warp-specialised" if kind == "ws" else f"{kind}-wise"
    explanation = (f"{label} ({cfg.describe()}) on {profile.full_name}: {why}; "
                   f"STOF's threshold {thr:+.4f} says {stof} and {agree}")
    return KernelChoice(kind, cfg, explanation, thr, block_us, row_us, ws_us)
