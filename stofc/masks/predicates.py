"""Vectorised mask predicates with tile-level classification and 8x8 bitmap packing.

Every predicate answers three questions, all on numpy arrays that broadcast:

* ``allowed(q, k)``: the MASKS.md predicate on element positions (int64). It
  must be right for ``0 <= q, k < L_max``; lookup-based predicates clip larger
  positions (their bits are masked off by the encoder anyway).
* ``classify(qlo, qhi, klo, khi)``: for outer tiles spanning in-range queries
  ``qlo..qhi`` and keys ``klo..khi`` (inclusive), ``FULL`` when the predicate
  certainly holds everywhere, ``EMPTY`` when it certainly holds nowhere, else
  ``MAYBE``. Leaves are exact where cheap; ``MAYBE`` is always safe because the
  encoder reclassifies from the computed bits.
* ``tile_words(q0, k0)``: ``uint64 [n, (T//8)**2]`` bitmaps of tiles starting
  at ``(q0, k0)`` (ITs column-major, bit ``r*8+c``), exact for in-range
  positions. Leaves evaluate ``allowed`` once per distinct *signature* (tiles
  with equal signatures have identical bitmaps: e.g. ``q0 - k0`` for
  predicates of ``q - k``) and gather; compositions combine their children's
  words with bit operations.

Classes are ordered ``EMPTY < MAYBE < FULL`` so a union is ``max``, an
intersection ``min`` and a complement ``FULL - c``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

EMPTY, MAYBE, FULL = 0, 1, 2
ONES = np.uint64(0xFFFFFFFFFFFFFFFF)
BIG = 1 << 62
_BATCH_ELEMS = 1 << 19  # elements evaluated per numpy batch (bounds temporaries)


def pack_tiles(bits: np.ndarray) -> np.ndarray:
    """bool ``[n, T, T]`` -> uint64 ``[n, (T//8)**2]`` (ITs column-major, bit ``r*8+c``)."""
    n, t, _ = bits.shape
    g = t // 8
    x = bits.reshape(n, g, 8, g, 8).transpose(0, 3, 1, 2, 4).reshape(n, g * g, 64)
    packed = np.packbits(x, axis=-1, bitorder="little")  # [n, W, 8] bytes, LSB first
    return np.ascontiguousarray(packed).view("<u8").reshape(n, g * g).astype(np.uint64)


def unpack_tiles(words: np.ndarray, tile: int) -> np.ndarray:
    """Inverse of :func:`pack_tiles`: uint64 ``[n, W]`` -> bool ``[n, T, T]``."""
    n = words.shape[0]
    g = tile // 8
    raw = np.ascontiguousarray(words.astype("<u8")).view(np.uint8).reshape(n, g * g, 8)
    bits = np.unpackbits(raw, axis=-1, bitorder="little").reshape(n, g, g, 8, 8)
    return bits.transpose(0, 2, 3, 1, 4).reshape(n, tile, tile).astype(bool)


def _bshape(*arrays: np.ndarray) -> tuple[int, ...]:
    return np.broadcast_shapes(*(np.shape(a) for a in arrays))


def _interval_class(lo, hi, a: int, b: int) -> np.ndarray:
    """Class of ``a <= x <= b`` for ``x`` ranging over ``[lo, hi]`` (elementwise)."""
    full = (lo >= a) & (hi <= b)
    empty = (hi < a) | (lo > b)
    return np.where(full, FULL, np.where(empty, EMPTY, MAYBE)).astype(np.int8)


class Pred(ABC):
    """A predicate compiled for one ``(L_max, tile)``."""

    def __init__(self, seq_len: int, tile: int) -> None:
        self.L = seq_len
        self.T = tile

    @abstractmethod
    def allowed(self, q: np.ndarray, k: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def classify(self, qlo, qhi, klo, khi) -> np.ndarray: ...

    def signature(self, q0: np.ndarray, k0: np.ndarray) -> np.ndarray | None:
        """``int64 [n, m]``: tiles with equal rows have equal bitmaps; None = no sharing."""
        return None

    def maybe_words(self, q0: np.ndarray, k0: np.ndarray) -> np.ndarray:
        """Bitmaps of tiles this predicate classified MAYBE (leaves: evaluate + share)."""
        sig = self.signature(q0, k0)
        if sig is None or len(q0) < 2:
            return self._evaluate(q0, k0)
        _, first, inverse = np.unique(sig, axis=0, return_index=True, return_inverse=True)
        return self._evaluate(q0[first], k0[first])[inverse.reshape(-1)]

    def _evaluate(self, q0: np.ndarray, k0: np.ndarray) -> np.ndarray:
        t = self.T
        ar = np.arange(t, dtype=np.int64)
        out = np.empty((len(q0), (t // 8) ** 2), dtype=np.uint64)
        step = max(1, _BATCH_ELEMS // (t * t))
        for s in range(0, len(q0), step):
            q = q0[s:s + step, None, None] + ar[None, :, None]
            k = k0[s:s + step, None, None] + ar[None, None, :]
            out[s:s + step] = pack_tiles(np.broadcast_to(self.allowed(q, k), (len(q), t, t)))
        return out

    def tile_words(self, q0: np.ndarray, k0: np.ndarray) -> np.ndarray:
        """Bitmaps of any tiles (1-D int64 starts): classify, then compute MAYBE ones."""
        q0 = np.asarray(q0, dtype=np.int64)
        k0 = np.asarray(k0, dtype=np.int64)
        qhi = np.minimum(q0 + self.T, self.L) - 1
        khi = np.minimum(k0 + self.T, self.L) - 1
        cls = np.broadcast_to(self.classify(q0, qhi, k0, khi), q0.shape)
        out = np.zeros((len(q0), (self.T // 8) ** 2), dtype=np.uint64)
        out[cls == FULL] = ONES
        maybe = np.flatnonzero(cls == MAYBE)
        if len(maybe):
            out[maybe] = self.maybe_words(q0[maybe], k0[maybe])
        return out


class Const(Pred):
    """``dense`` (value True) or nothing (False)."""

    def __init__(self, seq_len: int, tile: int, value: bool = True) -> None:
        super().__init__(seq_len, tile)
        self.value = value

    def allowed(self, q, k):
        return np.full(_bshape(q, k), self.value)

    def classify(self, qlo, qhi, klo, khi):
        return np.full(_bshape(qlo, klo), FULL if self.value else EMPTY, dtype=np.int8)


class DiffBand(Pred):
    """``a <= q - k <= b`` and ``(q - k) % d == 0``: causal, sliding, dilated."""

    def __init__(self, seq_len: int, tile: int, a: int, b: int, d: int = 1) -> None:
        super().__init__(seq_len, tile)
        self.a, self.b, self.d = a, b, d

    def allowed(self, q, k):
        diff = q - k
        ok = (diff >= self.a) & (diff <= self.b)
        return ok & (diff % self.d == 0) if self.d > 1 else ok

    def classify(self, qlo, qhi, klo, khi):
        dlo, dhi = qlo - khi, qhi - klo
        cls = _interval_class(dlo, dhi, self.a, self.b)
        if self.d > 1:
            lo, hi = np.maximum(dlo, self.a), np.minimum(dhi, self.b)
            no_multiple = (hi // self.d) * self.d < lo
            single = (dlo == dhi)  # a 1x1 tile: exact
            cls = np.where(no_multiple, EMPTY, np.where(single | (cls == EMPTY), cls, MAYBE))
            cls = cls.astype(np.int8)
        return cls

    def signature(self, q0, k0):
        return (q0 - k0)[:, None]


class BlockBand(Pred):
    """``abs(q // b - k // b) <= h``: BigBird's window, strided's diagonal blocks."""

    def __init__(self, seq_len: int, tile: int, block: int, half: int) -> None:
        super().__init__(seq_len, tile)
        self.block, self.half = block, half

    def allowed(self, q, k):
        return np.abs(q // self.block - k // self.block) <= self.half

    def classify(self, qlo, qhi, klo, khi):
        b = self.block
        return _interval_class(qlo // b - khi // b, qhi // b - klo // b, -self.half, self.half)

    def signature(self, q0, k0):
        b = self.block
        return np.stack([q0 % b, k0 % b, q0 // b - k0 // b], axis=1)


class FirstGlobal(Pred):
    """``q < G or k < G``."""

    def __init__(self, seq_len: int, tile: int, first: int) -> None:
        super().__init__(seq_len, tile)
        self.first = first

    def allowed(self, q, k):
        return (q < self.first) | (k < self.first)

    def classify(self, qlo, qhi, klo, khi):
        g = self.first
        full = (qhi < g) | (khi < g)
        empty = (qlo >= g) & (klo >= g)
        return np.where(full, FULL, np.where(empty, EMPTY, MAYBE)).astype(np.int8)

    def signature(self, q0, k0):
        lim = self.T + 1
        return np.stack([np.clip(self.first - q0, 0, lim), np.clip(self.first - k0, 0, lim)], 1)


class TokenGlobal(Pred):
    """``q in S or k in S`` for a token set ``S``."""

    def __init__(self, seq_len: int, tile: int, tokens: tuple[int, ...]) -> None:
        super().__init__(seq_len, tile)
        is_global = np.zeros(seq_len, dtype=bool)
        toks = np.asarray([t for t in tokens if t < seq_len], dtype=np.int64)
        is_global[toks] = True
        self.is_global = is_global
        self.before = np.concatenate([[0], np.cumsum(is_global)])  # tokens < x
        rows = -(-seq_len // tile)
        padded = np.zeros(rows * tile, dtype=bool)
        padded[:seq_len] = is_global
        _, self.pattern = np.unique(padded.reshape(rows, tile), axis=0, return_inverse=True)
        self.pattern = self.pattern.reshape(-1)

    def allowed(self, q, k):
        top = self.L - 1
        return self.is_global[np.minimum(q, top)] | self.is_global[np.minimum(k, top)]

    def classify(self, qlo, qhi, klo, khi):
        nq = self.before[qhi + 1] - self.before[qlo]
        nk = self.before[khi + 1] - self.before[klo]
        full = (nq == qhi - qlo + 1) | (nk == khi - klo + 1)
        empty = (nq == 0) & (nk == 0)
        return np.where(full, FULL, np.where(empty, EMPTY, MAYBE)).astype(np.int8)

    def signature(self, q0, k0):
        return np.stack([self.pattern[q0 // self.T], self.pattern[k0 // self.T]], axis=1)


class ColumnPeriodic(Pred):
    """``k % s == s - 1`` (strided's summary columns)."""

    def __init__(self, seq_len: int, tile: int, stride: int) -> None:
        super().__init__(seq_len, tile)
        self.stride = stride

    def allowed(self, q, k):
        return np.broadcast_to(k % self.stride == self.stride - 1, _bshape(q, k))

    def classify(self, qlo, qhi, klo, khi):
        s = self.stride
        count = (khi + 1) // s - klo // s
        cls = np.where(count == khi - klo + 1, FULL, np.where(count == 0, EMPTY, MAYBE))
        return np.broadcast_to(cls.astype(np.int8), _bshape(qlo, klo))

    def signature(self, q0, k0):
        return (k0 % self.stride)[:, None]
