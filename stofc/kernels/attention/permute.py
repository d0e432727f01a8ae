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

Cost. ``pi`` keeps every window of ``T * d`` positions in place, so a permuted tile
depends only on the ``d x d`` real tiles of its window pair: :func:`permute_format`
decodes, permutes and re-encodes the window pairs that hold a walked tile, in chunks
of at most ``CHUNK_BYTES`` (time and memory follow the walked tiles, never ``L x L``).
:func:`choose_permutation` is memoised on the format's content digest (layers with
the same mask share one search).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from stofc.kernels.attention.gather import TilePlan, plan_tiles, unpack_bits
from stofc.kernels.attention.reference import format_from_tiles
from stofc.masks.format import MaskFormat, content_digest

MIN_GAIN = 0.25          # keep a permutation only if it removes >= 25% of the walked tiles
MAX_SEQ = 8192           # the longest L the permuted kernels were validated at on the GPU
PERIODS = (2, 3, 4)
CHUNK_BYTES = 4 << 20    # decoded window pairs held at once by permute_format
MEMO_SIZE = 16       # permuted formats kept (a few MiB each at L = 8192)
Chosen = tuple[int, np.ndarray, MaskFormat]
_MEMO: OrderedDict[tuple, Chosen | None] = OrderedDict()


def residue_permutation(seq_len: int, tile: int, period: int) -> np.ndarray:
    """``pi``: permuted position -> real position (windows of ``tile*period`` by residue)."""
    p = np.arange(seq_len)
    key = (p // (tile * period)) * (tile * period) * period + (p % period) * (tile * period) + p
    return np.argsort(key, kind="stable").astype(np.int32)


def permute_format(fmt: MaskFormat, perm: np.ndarray, period: int) -> MaskFormat:
    """The format of ``mask[pi[i], pi[j]]`` (same tile, heads and L_max) for ``pi`` =
    :func:`residue_permutation` ``(fmt.seq_len, fmt.tile, period)`` (module doc: window
    pairs, never the dense mask)."""
    t, rows, d = fmt.tile, fmt.tile_rows, period
    w = t * d
    windows = -(-rows // d)
    local = np.tile(np.arange(w), (windows, 1))                  # [windows, W] within-window
    p = np.asarray(perm, dtype=np.int64)
    for i in range(windows):
        part = p[i * w:(i + 1) * w] - i * w
        local[i, :part.size] = part
    ptr = np.asarray(fmt.load_row_ptr, dtype=np.int64)
    counts = np.diff(ptr, axis=1).reshape(-1)
    head = np.repeat(np.arange(fmt.num_heads), rows)
    row = np.tile(np.arange(rows), fmt.num_heads)
    hh, rr = np.repeat(head, counts), np.repeat(row, counts)
    starts = ptr[:, :-1].reshape(-1)                             # (head, row) in CSR order
    order = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(counts.sum())
    cc = np.asarray(fmt.load_col_idx, dtype=np.int64)[order]
    pi = np.asarray(fmt.load_part_idx, dtype=np.int64)[order]
    pair_key = (hh * windows + rr // d) * windows + cc // d
    pairs, which = np.unique(pair_key, return_inverse=True)
    by_pair = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[by_pair], np.arange(0, pairs.size + 1))
    words = np.asarray(fmt.part_bitmaps, dtype=np.uint64).reshape(-1, (t // 8) ** 2)
    per_chunk = max(1, CHUNK_BYTES // (w * w * 2))
    out_h, out_r, out_c, out_bits = [], [], [], []
    for lo in range(0, pairs.size, per_chunk):
        n = min(per_chunk, pairs.size - lo)
        sel = by_pair[bounds[lo]:bounds[lo + n]]
        grid = np.zeros((n, d, t, d, t), dtype=bool)
        inside = np.arange(t)
        bits = (((rr[sel, None] * t + inside) < fmt.seq_len)[:, :, None]      # full tiles:
                & ((cc[sel, None] * t + inside) < fmt.seq_len)[:, None, :])   # in range only
        part = pi[sel] >= 0
        if part.any():
            bits[part] = unpack_bits(words[pi[sel][part]], t)
        grid[which[sel] - lo, rr[sel] % d, :, cc[sel] % d, :] = bits
        blocks = grid.reshape(n, w, w)
        del grid
        key = pairs[lo:lo + n]
        wi, wj, ph = (key // windows) % windows, key % windows, key // (windows * windows)
        blocks = np.take_along_axis(blocks, local[wi][:, :, None], axis=1)
        blocks = np.take_along_axis(blocks, local[wj][:, None, :], axis=2)
        tiles = blocks.reshape(n, d, t, d, t).transpose(0, 1, 3, 2, 4)    # pair, a, b, T, T
        k, a, b = np.nonzero(tiles.any(axis=(3, 4)))
        r, c = wi[k] * d + a, wj[k] * d + b
        keep = (r < rows) & (c < rows)
        out_h.append(ph[k][keep])
        out_r.append(r[keep])
        out_c.append(c[keep])
        out_bits.append(tiles[k[keep], a[keep], b[keep]])
    return format_from_tiles(fmt.num_heads, fmt.seq_len, t, np.concatenate(out_h),
                             np.concatenate(out_r), np.concatenate(out_c),
                             np.concatenate(out_bits))


def checkerboard_like(fmt: MaskFormat) -> bool:
    """Cheap pre-check: most walked tiles are part tiles at most ~half full."""
    words = np.asarray(fmt.part_bitmaps, dtype=np.uint64)
    walked = fmt.load_col_idx.size
    if not words.size or not walked:
        return False
    bits = np.unpackbits(words.astype("<u8").view(np.uint8), axis=-1)
    density = bits.reshape(words.shape[0], -1).mean(axis=1)
    return int((density <= 0.6).sum()) >= 0.5 * walked


def choose_permutation(fmt: MaskFormat) -> Chosen | None:
    """``(period, pi, permuted format)`` when a residue permutation pays, else None.
    Memoised on the format's content digest and this module's constants (the arrays
    returned are read-only and shared)."""
    key = (content_digest(fmt), MIN_GAIN, MAX_SEQ, PERIODS)
    if key in _MEMO:
        _MEMO.move_to_end(key)
        return _MEMO[key]
    chosen = _search(fmt)
    _MEMO[key] = chosen
    while len(_MEMO) > MEMO_SIZE:
        _MEMO.popitem(last=False)
    return chosen


def _search(fmt: MaskFormat) -> Chosen | None:
    if fmt.seq_len > MAX_SEQ or fmt.tile < 64 or not checkerboard_like(fmt):
        return None
    base = plan_tiles(fmt, gather=True).key_base.size
    best = None
    for d in PERIODS:
        if fmt.seq_len < 2 * fmt.tile * d:
            continue
        perm = residue_permutation(fmt.seq_len, fmt.tile, d)
        perm.setflags(write=False)
        pf = permute_format(fmt, perm, d)
        n = plan_tiles(pf, gather=True).key_base.size
        if n <= (1 - MIN_GAIN) * base and (best is None or n < best[0]):
            best = (n, d, perm, pf)
    return None if best is None else (best[1], best[2], best[3])


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
