"""Predicates backed by tables: BigBird's random blocks, block layouts, element bitmaps.

Their ``allowed`` clips positions to ``L_max - 1`` (out-of-range bits are masked
by the encoder); their classification is exact at tile level.
"""

from __future__ import annotations

import numpy as np

from stofc.masks.format import popcount
from stofc.masks.predicates import EMPTY, FULL, MAYBE, ONES, Pred


class RandomBlocks(Pred):
    """``k // b`` is one of block-row ``q // b``'s random blocks (``cols[i]``, -1 = none)."""

    def __init__(self, seq_len: int, tile: int, block: int, cols: np.ndarray) -> None:
        super().__init__(seq_len, tile)
        self.block = block
        self.cols = cols  # int64 [nb, r]
        self._tile_marks()

    def allowed(self, q, k):
        top, b = self.L - 1, self.block
        if self.cols.shape[1] == 0:
            return np.zeros(np.broadcast_shapes(np.shape(q), np.shape(k)), dtype=bool)
        rows = self.cols[np.minimum(q, top) // b]
        return (rows == (np.minimum(k, top) // b)[..., None]).any(axis=-1)

    def _tile_marks(self) -> None:
        """Every (random block, tile) pair, sorted by tile key ``tr * R + tc``.

        Sets ``pair_key`` and the pairs' in-range element rectangles (``pair_q``,
        ``pair_k``: inclusive bounds), and per distinct key (``keys``) the class
        of the tile: FULL when one block covers it, else MAYBE.
        """
        b, t, L = self.block, self.T, self.L
        R = -(-L // t)
        ii = np.repeat(np.arange(self.cols.shape[0], dtype=np.int64), self.cols.shape[1])
        jj = self.cols.reshape(-1)
        keep = jj >= 0
        ii, jj = ii[keep], jj[keep]
        qa, qb = ii * b, np.minimum(ii * b + b, L) - 1
        ka, kb = jj * b, np.minimum(jj * b + b, L) - 1
        tr0, tr1, tc0, tc1 = qa // t, qb // t, ka // t, kb // t
        span = -(-b // t) + 1
        keys, classes, rects = [], [], []
        for dr in range(span):
            tr = tr0 + dr
            for dc in range(span):
                tc = tc0 + dc
                ok = (tr <= tr1) & (tc <= tc1)
                if not ok.any():
                    continue
                r, c = tr[ok], tc[ok]
                covered = ((qa[ok] <= r * t) & (qb[ok] >= np.minimum(r * t + t, L) - 1)
                           & (ka[ok] <= c * t) & (kb[ok] >= np.minimum(c * t + t, L) - 1))
                keys.append(r * R + c)
                classes.append(np.where(covered, FULL, MAYBE).astype(np.int8))
                rects.append(np.stack([qa[ok], qb[ok], ka[ok], kb[ok]], axis=1))
        if not keys:
            key, cls, rect = np.zeros(0, np.int64), np.zeros(0, np.int8), np.zeros((0, 4), np.int64)
        else:
            key, cls, rect = np.concatenate(keys), np.concatenate(classes), np.concatenate(rects)
        order = np.lexsort((cls, key))
        key, cls, rect = key[order], cls[order], rect[order]
        self.pair_key, self.pair_rect = key, rect
        last = np.append(key[1:] != key[:-1], True) if len(key) else np.zeros(0, bool)
        self.keys, self.cls = key[last], cls[last]  # the max class of each key is last

    def maybe_words(self, q0, k0):
        """OR of the rectangles of the random blocks touching each tile (no element loop)."""
        t, g = self.T, self.T // 8
        R = -(-self.L // t)
        want = (q0 // t) * R + k0 // t
        lo = np.searchsorted(self.pair_key, want, side="left")
        hi = np.searchsorted(self.pair_key, want, side="right")
        counts = hi - lo
        out = np.zeros((len(q0), g * g), dtype=np.uint64)
        has = counts > 0
        if not has.any():
            return out
        owner = np.repeat(np.arange(len(q0)), counts)
        first = np.cumsum(counts) - counts
        pair = np.arange(counts.sum()) - np.repeat(first, counts) + np.repeat(lo, counts)
        rect = self.pair_rect[pair]
        ar = np.arange(t)
        rows = (ar >= (rect[:, 0] - q0[owner])[:, None]) & (ar <= (rect[:, 1] - q0[owner])[:, None])
        cols = (ar >= (rect[:, 2] - k0[owner])[:, None]) & (ar <= (rect[:, 3] - k0[owner])[:, None])
        # An IT word is colbyte(ic) * rowspread(ir): each selected row's byte holds the columns.
        row_spread = (rows.reshape(-1, g, 8).astype(np.uint64)
                      << (np.arange(8, dtype=np.uint64) * np.uint64(8))).sum(axis=2, dtype=np.uint64)
        col_byte = (cols.reshape(-1, g, 8).astype(np.uint64)
                    << np.arange(8, dtype=np.uint64)).sum(axis=2, dtype=np.uint64)
        words = (col_byte[:, :, None] * row_spread[:, None, :]).reshape(-1, g * g)
        starts = first[has]
        out[has] = np.bitwise_or.reduceat(words, starts, axis=0)
        return out

    def classify(self, qlo, qhi, klo, khi):
        R = -(-self.L // self.T)
        key = (qlo // self.T) * R + klo // self.T
        if len(self.keys) == 0:
            return np.full(np.shape(key), EMPTY, dtype=np.int8)
        pos = np.minimum(np.searchsorted(self.keys, key), len(self.keys) - 1)
        return np.where(self.keys[pos] == key, self.cls[pos], EMPTY).astype(np.int8)


def _spread(sel: np.ndarray, shift: int) -> np.ndarray:
    """bool ``[..., 8]`` -> uint64 ``[...]`` with bit ``i * shift`` set for each selected i."""
    weights = np.left_shift(np.uint64(1), np.arange(8, dtype=np.uint64) * np.uint64(shift))
    return (sel.astype(np.uint64) * weights).sum(axis=-1, dtype=np.uint64)


class BlockLayout(Pred):
    """``layout[q // b, k // b]`` (blocksparse); ``layout`` covers ``ceil(L_max / b)`` blocks.

    Bitmaps are built per 8x8 IT without touching elements: the IT's 8 rows
    meet at most ``m = ceil(8 / b) + 1`` block rows (likewise columns), so
    its word is the OR over block pairs ``(a, c)`` of
    ``layout[a, c] * colbyte(c) * rowspread(a)``.
    """

    _BATCH = 4096  # tiles per batch (bounds the [n, g, g] temporaries)

    def __init__(self, seq_len: int, tile: int, block: int, layout: np.ndarray) -> None:
        super().__init__(seq_len, tile)
        nb = -(-seq_len // block)
        self.block = block
        self.layout = np.ascontiguousarray(layout[:nb, :nb])
        prefix = np.zeros((nb + 1, nb + 1), dtype=np.int64 if nb > 40000 else np.int32)
        np.cumsum(np.cumsum(self.layout, axis=0, dtype=prefix.dtype), axis=1, out=prefix[1:, 1:])
        self.prefix = prefix
        # ITs start at multiples of 8: with 8 | b an IT lies inside one block.
        self.parts = 1 if block % 8 == 0 else -(-8 // block) + 1
        pad = nb + self.parts + tile // block + 1
        self.padded = np.zeros((pad, pad), dtype=bool)  # blocks past L_max are 0
        self.padded[:nb, :nb] = self.layout

    def allowed(self, q, k):
        top, b = self.L - 1, self.block
        return self.layout[np.minimum(q, top) // b, np.minimum(k, top) // b]

    def classify(self, qlo, qhi, klo, khi):
        b, p = self.block, self.prefix
        i0, i1, j0, j1 = qlo // b, qhi // b + 1, klo // b, khi // b + 1
        count = p[i1, j1] - p[i0, j1] - p[i1, j0] + p[i0, j0]
        area = (i1 - i0) * (j1 - j0)
        return np.where(count == area, FULL, np.where(count == 0, EMPTY, MAYBE)).astype(np.int8)

    def maybe_words(self, q0, k0):
        g, b = self.T // 8, self.block
        out = np.empty((len(q0), g * g), dtype=np.uint64)
        it = np.arange(g, dtype=np.int64) * 8
        r8 = np.arange(8, dtype=np.int64)
        for s in range(0, len(q0), self._BATCH):
            qs, ks = q0[s:s + self._BATCH], k0[s:s + self._BATCH]
            qpos = qs[:, None, None] + it[None, :, None] + r8   # [n, g(ir), 8]
            kpos = ks[:, None, None] + it[None, :, None] + r8   # [n, g(ic), 8]
            qb0, kb0 = qpos[:, :, 0] // b, kpos[:, :, 0] // b   # first block of each IT
            if self.parts == 1:
                on = self.padded[qb0[:, None, :], kb0[:, :, None]]       # [n, ic, ir]
                out[s:s + self._BATCH] = np.where(on, ONES, np.uint64(0)).reshape(len(qs), -1)
                continue
            words = np.zeros((len(qs), g, g), dtype=np.uint64)  # [n, ic, ir]
            for a in range(self.parts):
                rows = _spread(qpos // b == (qb0 + a)[:, :, None], 8)          # [n, ir]
                if not rows.any():
                    continue
                for c in range(self.parts):
                    cols = _spread(kpos // b == (kb0 + c)[:, :, None], 1)      # [n, ic]
                    on = self.padded[(qb0 + a)[:, None, :], (kb0 + c)[:, :, None]]
                    words |= np.where(on, cols[:, :, None] * rows[:, None, :], np.uint64(0))
            out[s:s + self._BATCH] = words.reshape(len(qs), g * g)
        return out


class BitmapArray(Pred):
    """``m[q, k]`` for a user-given boolean ``[N, N]`` array, ``N >= L_max``.

    The array is packed once into IT words (``L^2 / 8`` bytes): tile counts
    come from their popcounts and tile bitmaps are a gather.
    """

    def __init__(self, seq_len: int, tile: int, array: np.ndarray) -> None:
        super().__init__(seq_len, tile)
        L, g = seq_len, tile // 8
        self.m = array[:L, :L]
        R = -(-L // tile)
        packed = np.packbits(self.m, axis=1, bitorder="little")      # [L, ceil(L/8)]
        side = R * g
        rows = np.zeros((side * 8, side), dtype=np.uint8)
        rows[:L, :packed.shape[1]] = packed
        words = np.ascontiguousarray(rows.reshape(side, 8, side).transpose(0, 2, 1))
        self.words = words.view("<u8").reshape(side, side).astype(np.uint64, copy=False)
        counts = popcount(self.words).reshape(R, g, R, g).sum(axis=(1, 3), dtype=np.int64)
        self.counts = counts.astype(np.int64)

    def allowed(self, q, k):
        top = self.L - 1
        return self.m[np.minimum(q, top), np.minimum(k, top)]

    def maybe_words(self, q0, k0):
        g = self.T // 8
        ar = np.arange(g)
        sub = self.words[(q0 // 8)[:, None, None] + ar[None, None, :],
                         (k0 // 8)[:, None, None] + ar[None, :, None]]   # [n, ic, ir]
        return sub.reshape(len(q0), g * g)

    def classify(self, qlo, qhi, klo, khi):
        count = self.counts[qlo // self.T, klo // self.T]
        area = (qhi - qlo + 1) * (khi - klo + 1)
        return np.where(count == area, FULL, np.where(count == 0, EMPTY, MAYBE)).astype(np.int8)
