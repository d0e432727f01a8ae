"""Row-wise attention (family ``attention_row``): one warp per query row, the bitmap walked.

Template ``attention/row.cu.j2``. A warp owns ``warp_m`` (1, 2 or 4) query rows, a
block ``warps * warp_m`` consecutive rows inside one tile row; it walks the format's
load list itself (no walk list of its own) and re-reads one K and one V row per
allowed element from L1/L2, testing the 8x8 bitmaps.

Cost model (the selector's, :meth:`AttentionRow.estimate_us`): every allowed element
re-reads one K and one V row (``4 D`` bytes) from L1/L2 at ``ROW_BYTES_FACTOR`` x DRAM
bandwidth, and every (query row, walked tile) pair costs a bitmap scan
(``ROW_SCAN_NS_SM``); fitted on an H200 to causal and strided at L=4096 (25.3 and
3.6 ms), checked on the other four.
"""

from __future__ import annotations

import math

import numpy as np

from stofc.kernels.attention.config import (
    REG_OVERHEAD,
    AttentionConfig,
    ExtraInputs,
    prune,
    q_in_registers,
    resource_reason,
)
from stofc.kernels.attention.family import AttentionFamily
from stofc.kernels.attention.launch import Walk
from stofc.kernels.registry import register
from stofc.masks.format import MaskFormat
from stofc.targets import GpuProfile

ROW_BYTES_FACTOR = 0.91   # row-wise: 4*D bytes of K/V per allowed element at 0.91 x DRAM BW
ROW_SCAN_NS_SM = 36.0     # row-wise: ns x SMs per (query row, walked tile) bitmap scan
ROW_LATENCY_US = 1.5      # per wave: the first K row's latency


def row_config(fmt: MaskFormat, profile: GpuProfile, *, batch: int, heads: int,
               seq_len: int) -> AttentionConfig:
    """Starting row-wise config: 4 warps; 2 rows per warp once the grid has 8 waves."""
    t = fmt.tile
    rows_needed = batch * heads * seq_len
    warp_m = 2 if rows_needed >= 8 * 2 * 4 * profile.sm_count * 16 and t % 8 == 0 else 1
    return AttentionConfig("row", t, warp_m, 4)


@register
class AttentionRow(AttentionFamily):
    """Row-wise attention (see the module doc)."""

    name = "attention_row"
    kind = "row"
    label = "row-wise"
    stof_class = "row"
    plan_code = 1
    templates = ("attention/row.cu.j2",)
    preference = 10
    space_order = 10
    tuner_tag = (("kind", "row"),)

    def rows_per_block(self, config: AttentionConfig) -> int:
        return config.warps * config.warp_m

    def describe(self, config: AttentionConfig) -> str:
        return f"row-wise T={config.tile} warps={config.warps} rows/warp={config.warp_m}"

    def smem_bytes(self, config: AttentionConfig, head_dim: int) -> int:
        q_row = 0 if q_in_registers(head_dim) else config.warps * head_dim * 4
        return config.warps * 64 * 4 + q_row

    def registers(self, config: AttentionConfig, head_dim: int) -> int:
        q = head_dim if q_in_registers(head_dim) else 0
        return q + 2 * ((head_dim // 2 + 31) // 32) + 16 + REG_OVERHEAD // 2

    def prune(self, config: AttentionConfig, head_dim: int, profile: GpuProfile) -> str | None:
        c = config
        if c.warp_m not in (1, 2, 4) or c.warps not in (1, 2, 4, 8):
            return "row-wise: 1, 2 or 4 rows per warp and 1..8 warps"
        if c.tile % self.rows_per_block(c):
            return "row-wise: a block's rows must lie inside one tile row (T % rows == 0)"
        if (c.stages != 1 or c.q_split != 1 or c.gather or c.permute or c.min_blocks != 1
                or c.mma != "sync"):
            return "row-wise has no pipeline stages, query split, gathered tiles or wgmma"
        return resource_reason(c, head_dim, profile)

    def search_space(self, head_dim: int, profile: GpuProfile, *, tile: int, gatherable: bool,
                     permutable: bool) -> list[AttentionConfig]:
        out = []
        for warps in (1, 2, 4, 8):
            for warp_m in (1, 2, 4):
                cfg = AttentionConfig("row", tile, warp_m, warps)
                if prune(cfg, head_dim, profile) is None:
                    out.append(cfg)
        return out

    # -- the selector -----------------------------------------------------------------
    def starting_config(self, fmt: MaskFormat, profile: GpuProfile, *, batch: int, heads: int,
                        seq_len: int, head_dim: int, extras: ExtraInputs
                        ) -> AttentionConfig | None:
        return row_config(fmt, profile, batch=batch, heads=heads, seq_len=seq_len)

    def estimate_us(self, fmt: MaskFormat, profile: GpuProfile, config: AttentionConfig, *,
                    batch: int, heads: int, seq_len: int, head_dim: int) -> float:
        t = fmt.tile
        rows = math.ceil(seq_len / t)
        hf = heads if fmt.num_heads == 1 else 1          # heads per format head
        nnz = float(np.asarray(fmt.row_nnz)[:, :rows].sum()) * batch * hf
        ptr = np.asarray(fmt.load_row_ptr, dtype=np.int64)
        row_tiles = float((ptr[:, 1:rows + 1] - ptr[:, :rows]).sum()) * t * batch * hf
        bytes_rate = ROW_BYTES_FACTOR * profile.mem_bandwidth_gbs * 1e9
        row_us = nnz * 4.0 * head_dim / bytes_rate * 1e6
        row_us += row_tiles * ROW_SCAN_NS_SM / profile.sm_count * 1e-3 + ROW_LATENCY_US
        return row_us

    def advantage(self, fmt: MaskFormat) -> str:
        return (f"the allowed elements are too scattered for {fmt.tile}x{fmt.tile} "
                "tensor-core tiles")

    # -- launch -----------------------------------------------------------------------
    def blocks_per_tile_row(self, config: AttentionConfig) -> int:
        return config.tile // self.rows_per_block(config)

    def dynamic_smem(self, config: AttentionConfig, head_dim: int) -> int:
        return 0                                   # the row-wise kernel's smem is static

    def walk(self, fmt: MaskFormat, config: AttentionConfig) -> Walk:
        """The format's own load list (row-wise kernels walk it with the bitmaps)."""
        return Walk(fmt.load_row_ptr, fmt.load_col_idx, fmt.load_part_idx, fmt.part_bitmaps,
                    np.zeros(0, np.int32), fmt.row_nnz)
