"""Predicates backed by tables: BigBird's random blocks, block layouts, element bitmaps.

Their ``allowed`` clips positions to ``L_max - 1`` (out-of-range bits are masked
by the encoder); their classification is exact at tile level.
"""

from __future__ import annotations

import numpy as np

from stofc.masks.predicates import EMPTY, FULL, MAYBE, Pred


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


class BlockLayout(Pred):
    """``layout[q // b, k // b]`` (blocksparse); ``layout`` covers ``ceil(L_max / b)`` blocks."""

    def __init__(self, seq_len: int, tile: int, block: int, layout: np.ndarray) -> None:
        super().__init__(seq_len, tile)
        nb = -(-seq_len // block)
        self.block = block
        self.layout = np.ascontiguousarray(layout[:nb, :nb])
        prefix = np.zeros((nb + 1, nb + 1), dtype=np.int64 if nb > 40000 else np.int32)
        np.cumsum(np.cumsum(self.layout, axis=0, dtype=prefix.dtype), axis=1, out=prefix[1:, 1:])
        self.prefix = prefix
        self.group = tile // block if tile % block == 0 and tile // block <= 8 else 0
        if self.group:
            g = self.group
            padded = np.zeros((-(-nb // g) * g,) * 2, dtype=bool)
            padded[:nb, :nb] = self.layout
            self.padded = padded

    def allowed(self, q, k):
        top, b = self.L - 1, self.block
        return self.layout[np.minimum(q, top) // b, np.minimum(k, top) // b]

    def classify(self, qlo, qhi, klo, khi):
        b, p = self.block, self.prefix
        i0, i1, j0, j1 = qlo // b, qhi // b + 1, klo // b, khi // b + 1
        count = p[i1, j1] - p[i0, j1] - p[i1, j0] + p[i0, j0]
        area = (i1 - i0) * (j1 - j0)
        return np.where(count == area, FULL, np.where(count == 0, EMPTY, MAYBE)).astype(np.int8)

    def signature(self, q0, k0):
        if not self.group:
            return None
        g, b = self.group, self.block
        ar = np.arange(g)
        sub = self.padded[(q0 // b)[:, None, None] + ar[None, :, None],
                          (k0 // b)[:, None, None] + ar[None, None, :]]
        weights = np.left_shift(np.int64(1), np.arange(g * g, dtype=np.int64))
        return (sub.reshape(len(q0), g * g).astype(np.int64) @ weights)[:, None]


class BitmapArray(Pred):
    """``m[q, k]`` for a user-given boolean ``[N, N]`` array, ``N >= L_max``."""

    def __init__(self, seq_len: int, tile: int, array: np.ndarray) -> None:
        super().__init__(seq_len, tile)
        self.m = array[:seq_len, :seq_len]
        R = -(-seq_len // tile)
        edges = np.arange(0, seq_len, tile)
        counts = np.zeros((R, R), dtype=np.int32)
        step = max(1, (1 << 22) // (seq_len * tile))
        for r0 in range(0, R, step):
            r1 = min(R, r0 + step)
            rows = self.m[r0 * tile:min(r1 * tile, seq_len)]
            per_col = np.add.reduceat(rows, edges, axis=1, dtype=np.int32)
            counts[r0:r1] = np.add.reduceat(per_col, edges[: r1 - r0], axis=0, dtype=np.int32)
        self.counts = counts

    def allowed(self, q, k):
        top = self.L - 1
        return self.m[np.minimum(q, top), np.minimum(k, top)]

    def classify(self, qlo, qhi, klo, khi):
        count = self.counts[qlo // self.T, klo // self.T]
        area = (qhi - qlo + 1) * (khi - klo + 1)
        return np.where(count == area, FULL, np.where(count == 0, EMPTY, MAYBE)).astype(np.int8)
