"""The warp-specialised kernel's starting config and time estimate (for the selector).

Calibrated on an H100 (bench/results/mha-hopper-*-2026-11-25: the ws kernel at B=1 H=16
L=8192, D=128 bf16 and B=2 H=12 L=8192, D=64 fp16): a full 64x64 tile step of one
consumer warpgroup runs at ``ws_efficiency(D)`` of the fp16 tensor peak (about 505
TFLOP/s dense at D=128, 340 at D=64: the softmax of a 64-key step is not hidden as well
under a D=64 GEMM); part tiles cost MASKED_TILE_COST full ones; each thread block
(one work item) pays WS_BLOCK_US of start and end (barriers, Q load, pipeline fill,
epilogue), measured from local windows (4 tiles per pair row: 11 us per wave of 132).
The grid runs one block per SM; the longest item bounds the time from below, which
the row split (:func:`~stofc.kernels.attention.ws_plan.default_split`) keeps short.
"""

from __future__ import annotations

import math

import numpy as np

from stofc.kernels.attention.config import AttentionConfig, prune
from stofc.kernels.attention.ws_plan import SKIP, WS_ROWS, WsPlan, default_split, plan_ws
from stofc.masks.format import MaskFormat
from stofc.targets import GpuProfile

WS_EFFICIENCY_D64 = 0.34
WS_EFFICIENCY_D128 = 0.51
WS_BLOCK_US = 6.0
MASKED_TILE_COST = 1.45


def ws_efficiency(head_dim: int) -> float:
    """Fraction of the fp16 tensor peak a full tile step reaches (measured at 64 and 128)."""
    if head_dim <= 64:
        return WS_EFFICIENCY_D64
    return WS_EFFICIENCY_D128


def ws_config(fmt: MaskFormat, profile: GpuProfile, *, batch: int, heads: int,
              head_dim: int) -> AttentionConfig | None:
    """The starting ws config (2-stage ring, ping-pong, one tile per step: the fastest or
    within noise of it in the H100 sweep), rows split for this batch and head count; None
    where :func:`~stofc.kernels.attention.config.prune` refuses it (not Hopper, tile or
    head_dim)."""
    probe = AttentionConfig("ws", 64, 16, 12, 2, 1, mma="wgmma", pingpong=True)
    if fmt.tile != 64 or prune(probe, head_dim, profile) is not None:
        return None
    split = default_split(fmt, batch=batch, heads=heads, sm_count=profile.sm_count)
    return AttentionConfig("ws", 64, 16, 12, 2, 1, mma="wgmma", pingpong=True, split=split)


def _item_work(plan: WsPlan, head: int, seq_len: int) -> np.ndarray:
    """Weighted warpgroup-tiles of every item of ``head`` that a run of ``seq_len`` does."""
    parts = np.asarray(plan.entry_part[:-2]).reshape(-1, 2)
    keys = np.asarray(plan.entry_key[:-1])
    live = keys < seq_len
    active = ((parts != SKIP) & live[:, None]).sum(axis=1).astype(np.float64)
    masked = ((parts >= 0) & live[:, None]).sum(axis=1) * (MASKED_TILE_COST - 1.0)
    work = np.concatenate([[0.0], np.cumsum(active + masked)])
    items = plan.items[head]
    ok = (items[:, 0] >= 0) & (items[:, 0] * WS_ROWS < seq_len)
    return np.where(ok, work[items[:, 2]] - work[items[:, 1]], 0.0)


def ws_estimate(fmt: MaskFormat, profile: GpuProfile, cfg: AttentionConfig, *, batch: int,
                heads: int, seq_len: int, head_dim: int) -> float:
    """Estimated microseconds of the ws kernel (and its combine) for one launch."""
    plan = plan_ws(fmt, split_tiles=cfg.split)
    per_fmt_head = heads if fmt.num_heads == 1 else 1
    tile_flops = 4.0 * 64 * 64 * head_dim
    rate = ws_efficiency(head_dim) * profile.fp16_tflops * 1e12
    works = [_item_work(plan, h, seq_len) for h in range(plan.num_heads)]
    total = sum(float(w.sum()) for w in works) * per_fmt_head * batch * tile_flops
    longest = max(float(w.max()) if w.size else 0.0 for w in works) * tile_flops
    blocks = sum(int((w > 0).sum()) for w in works) * per_fmt_head * batch
    waves = math.ceil(blocks / profile.sm_count) if blocks else 0
    us = max(total / rate, longest / (rate / profile.sm_count)) * 1e6
    return us + waves * WS_BLOCK_US
