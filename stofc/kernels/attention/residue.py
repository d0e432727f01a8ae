"""Residue split: a dilated mask as ``P`` interleaved bands for the warp-specialised kernel.

A mask of period ``P`` allows ``(q, k)`` only when ``q - k`` is a multiple of ``P``
(MASKS.md ``dilated``, alone or ANDed with causal or a window). Walked in 64 x 64
tiles it is a checkerboard: every tile is part-allowed and the kernel computes ``P``
times the work it keeps. Queries and keys of one residue ``r = q % P`` only meet
each other, so the mask is ``P`` independent sub-masks over every ``P``-th row:
``M_r(a, c) = M(P a + r, P c + r)``. When every residue's sub-mask is the same ``S``
(a mask that depends on ``q - k`` only, as dilated bands do, up to each residue's own
length ``L_r = ceil((L - r) / P)``), the kernel walks ``S`` once per residue, as if
the batch were ``P`` times larger: its tensor maps step ``P`` rows per loaded row
(TMA element strides), so no data is moved and a dilation-2 band of +-256 becomes a
dense band of +-128 over half the rows (``templates/attention/block_ws.cu.j2``,
``PERIOD``).

:func:`residue_format` checks one period and builds ``S``; :func:`choose_period`
tries :data:`PERIODS` (largest first: a period-4 mask is also 2-periodic, and the
larger split wastes less) and is memoised on the format's content. Work and memory
follow the walked tiles, one format head at a time, never ``L x L``.

Contract of ``S`` (what the kernel relies on): for every residue ``r < P`` and every
run length ``L <= L_max``, ``M(P a + r, P c + r) == S(a, c)`` for ``a, c <
ceil((L - r) / P)``, and ``M(q, k)`` is false whenever ``(q - k) % P != 0``.
``S.seq_len`` is ``ceil(L_max / P)``.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from stofc.kernels.attention.gather import unpack_bits
from stofc.kernels.attention.reference import format_from_tiles
from stofc.masks.format import MaskFormat, content_digest

PERIODS = (4, 2)     # periods the kernel supports: 64 * P rows per TMA box (<= 256), P | 8
TILE = 64            # the ws kernel's mask tile
MEMO_SIZE = 16
_MEMO: OrderedDict[tuple, tuple[int, MaskFormat] | None] = OrderedDict()


def pure_word(period: int) -> np.uint64:
    """The 8x8 inner-tile word of every element a period-``period`` mask may allow:
    bit ``r * 8 + c`` set when ``(r - c) % period == 0`` (``period`` divides 8, so the
    pattern is the same in every inner tile of every outer tile)."""
    bits = sum(1 << (r * 8 + c) for r in range(8) for c in range(8) if (r - c) % period == 0)
    return np.uint64(bits)


def _residue_tiles(rows: np.ndarray, cols: np.ndarray, bits: np.ndarray, period: int,
                   residue: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One residue's sub-mask of a head, from its walked part tiles ``(rows, cols, bits)``:
    sub-tile rows, columns and ``[n, 64, 64]`` contents (each real tile gives a
    ``64/P``-square block of the sub-tile ``(R // P, C // P)``)."""
    s = TILE // period
    block = bits[:, residue::period, residue::period]                 # [n, s, s]
    keep = block.any(axis=(1, 2))
    rows, cols, block = rows[keep], cols[keep], block[keep]
    width = int(cols.max()) // period + 1 if cols.size else 1
    key = (rows // period) * width + cols // period
    uniq, which = np.unique(key, return_inverse=True)
    out = np.zeros((uniq.size, TILE, TILE), dtype=bool)
    for a in range(period):
        for b in range(period):
            sel = (rows % period == a) & (cols % period == b)
            out[which[sel], a * s:(a + 1) * s, b * s:(b + 1) * s] = block[sel]
    return uniq // width, uniq % width, out


def residue_format(fmt: MaskFormat, period: int) -> MaskFormat | None:
    """``S`` (module doc) when ``fmt`` is a period-``period`` mask whose residues share one
    sub-mask, else None. Only for ``tile`` 64 and ``period`` in :data:`PERIODS`."""
    if fmt.tile != TILE or period not in PERIODS or fmt.seq_len < 2 * TILE * period:
        return None
    parts = np.asarray(fmt.load_part_idx)
    if parts.size == 0 or (parts < 0).any():        # a full tile holds (q, q + 1) pairs
        return None
    words = np.asarray(fmt.part_bitmaps, dtype=np.uint64)
    if (words & ~pure_word(period)).any():
        return None
    n = fmt.seq_len
    n_sub = -(-n // period)
    lengths = [-(-(n - r) // period) for r in range(period)]
    ptr = np.asarray(fmt.load_row_ptr, dtype=np.int64)
    col_idx = np.asarray(fmt.load_col_idx, dtype=np.int64)
    out_h, out_r, out_c, out_bits = [], [], [], []
    for h in range(fmt.num_heads):
        a, b = int(ptr[h, 0]), int(ptr[h, -1])
        counts = np.diff(ptr[h])
        rows = np.repeat(np.arange(counts.size), counts)
        cols = col_idx[a:b]
        bits = unpack_bits(words[parts[a:b]], TILE)
        base_r, base_c, base = _residue_tiles(rows, cols, bits, period, 0)
        for r in range(1, period):
            rr, cc, sub = _residue_tiles(rows, cols, bits, period, r)
            if not _same_within(base_r, base_c, base, rr, cc, sub, lengths[r]):
                return None
        out_h.append(np.full(base_r.size, h))
        out_r.append(base_r)
        out_c.append(base_c)
        out_bits.append(base)
    return format_from_tiles(fmt.num_heads, n_sub, TILE, np.concatenate(out_h),
                             np.concatenate(out_r), np.concatenate(out_c),
                             np.concatenate(out_bits),
                             digest=f"{fmt.spec_hash}/period{period}")


def _same_within(r0: np.ndarray, c0: np.ndarray, t0: np.ndarray, r1: np.ndarray,
                 c1: np.ndarray, t1: np.ndarray, length: int) -> bool:
    """Whether two sub-masks (sub-tile lists) agree on ``[0, length)^2``."""
    width = int(max(c0.max() if c0.size else 0, c1.max() if c1.size else 0)) + 1
    k0, k1 = r0 * width + c0, r1 * width + c1
    keys = np.union1d(k0, k1)
    a = np.zeros((keys.size, TILE, TILE), dtype=bool)
    b = np.zeros_like(a)
    a[np.searchsorted(keys, k0)] = t0
    b[np.searchsorted(keys, k1)] = t1
    inside = np.arange(TILE)
    rows_ok = (keys // width)[:, None] * TILE + inside < length
    cols_ok = (keys % width)[:, None] * TILE + inside < length
    valid = rows_ok[:, :, None] & cols_ok[:, None, :]
    return not ((a ^ b) & valid).any()


def choose_period(fmt: MaskFormat) -> tuple[int, MaskFormat] | None:
    """``(P, S)`` for the largest period of :data:`PERIODS` that splits ``fmt``
    (:func:`residue_format`), else None. Memoised on the format's content (the formats
    returned are read-only and shared)."""
    key = (content_digest(fmt), PERIODS)
    if key in _MEMO:
        _MEMO.move_to_end(key)
        return _MEMO[key]
    chosen = None
    for period in PERIODS:
        sub = residue_format(fmt, period)
        if sub is not None:
            chosen = (period, sub)
            break
    _MEMO[key] = chosen
    while len(_MEMO) > MEMO_SIZE:
        _MEMO.popitem(last=False)
    return chosen


def split_format(fmt: MaskFormat, period: int) -> MaskFormat:
    """``S`` of a config's ``period`` (1: ``fmt`` itself); ValueError when ``fmt`` does not
    split with that period (a config chosen on another mask)."""
    if period == 1:
        return fmt
    chosen = choose_period(fmt)
    if chosen is not None and chosen[0] == period:
        return chosen[1]
    sub = residue_format(fmt, period)
    if sub is None:
        raise ValueError(f"the mask does not split into {period} residues "
                         f"(a ws config with period {period} was chosen for another mask)")
    return sub
