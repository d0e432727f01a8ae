"""Residue permutation: make periodic masks (dilation) dense for the block-wise kernel.

A dilated mask allows ``(q, k)`` only when ``q - k`` is a multiple of ``d``: every
outer tile is a checkerboard, half (or more) of its tensor-core work wasted, and
column gathering cannot help (every column is occupied by some row). Permuting
queries and keys alike by ``pi`` -- inside each window of ``T * d`` positions,
positions grouped by residue ``p % d`` -- turns the checkerboard into dense
tiles. The kernel then reads Q rows and K/V rows through ``pi`` and writes O
rows through it; the function computed is unchanged (attention is equivariant
under a joint permutation of queries and keys).

:func:`choose_permutation` tries ``d`` in 2..4 and keeps the one that cuts the
walked tiles by at least ``MIN_GAIN``; :func:`permuted_plan` builds the walk
list in permuted space with every tile gathered (K/V rows by real key index).
"""

from __future__ import annotations

import numpy as np

from stofc.kernels.attention.gather import TilePlan, plan_tiles
from stofc.kernels.attention.reference import dense_from_format, format_from_dense
from stofc.masks.format import MaskFormat

MIN_GAIN = 0.25          # keep a permutation only if it removes >= 25% of the walked tiles
MAX_SEQ = 8192           # the search materialises the dense mask: bounded cost
PERIODS = (2, 3, 4)


def residue_permutation(seq_len: int, tile: int, period: int) -> np.ndarray:
    """``pi``: permuted position -> real position (windows of ``tile*period`` by residue)."""
    p = np.arange(seq_len)
    key = (p // (tile * period)) * (tile * period) * period + (p % period) * (tile * period) + p
    return np.argsort(key, kind="stable").astype(np.int32)


def permute_format(fmt: MaskFormat, perm: np.ndarray) -> MaskFormat:
    """The format of ``mask[pi[i], pi[j]]`` (same tile, heads and L_max)."""
    dense = dense_from_format(fmt)
    return format_from_dense(dense[:, perm][:, :, perm], fmt.tile)


def checkerboard_like(fmt: MaskFormat) -> bool:
    """Cheap pre-check: most walked tiles are part tiles at most ~half full."""
    words = np.asarray(fmt.part_bitmaps, dtype=np.uint64)
    walked = fmt.load_col_idx.size
    if not words.size or not walked:
        return False
    bits = np.unpackbits(words.astype("<u8").view(np.uint8), axis=-1)
    density = bits.reshape(words.shape[0], -1).mean(axis=1)
    return int((density <= 0.6).sum()) >= 0.5 * walked


def choose_permutation(fmt: MaskFormat) -> tuple[int, np.ndarray, MaskFormat] | None:
    """``(period, pi, permuted format)`` when a residue permutation pays, else None."""
    if fmt.seq_len > MAX_SEQ or fmt.tile < 64 or not checkerboard_like(fmt):
        return None
    base = plan_tiles(fmt, gather=True).key_base.size
    best = None
    for d in PERIODS:
        if fmt.seq_len < 2 * fmt.tile * d:
            continue
        perm = residue_permutation(fmt.seq_len, fmt.tile, d)
        pf = permute_format(fmt, perm)
        n = plan_tiles(pf, gather=True).key_base.size
        if n <= (1 - MIN_GAIN) * base and (best is None or n < best[0]):
            best = (n, d, perm, pf)
    return None if best is None else best[1:]


def permuted_plan(pfmt: MaskFormat, perm: np.ndarray, *, gather: bool) -> TilePlan:
    """Walk list of the permuted format with every tile gathered by REAL key index."""
    plan = plan_tiles(pfmt, gather=gather)
    t, n = pfmt.tile, pfmt.seq_len
    padded = np.full(pfmt.tile_rows * t, -1, dtype=np.int64)
    padded[:n] = perm
    old = plan.gather_keys.astype(np.int64)
    mapped = np.where(old >= 0, padded[np.clip(old, 0, None)], -1)
    contiguous = padded.reshape(pfmt.tile_rows, t)               # gathered list of tile column c
    gather_keys = np.concatenate([mapped.reshape(-1, t), contiguous]) if old.size else contiguous
    first_col = old.shape[0]
    kb = plan.key_base.astype(np.int64)
    key_base = np.where(kb >= 0, -(first_col + kb // t) - 1, kb)  # contiguous c -> gathered c
    return TilePlan(t, plan.num_heads, plan.row_ptr, key_base.astype(np.int32), plan.part_idx,
                    plan.bitmaps, gather_keys.astype(np.int32), plan.tiles_per_row)
