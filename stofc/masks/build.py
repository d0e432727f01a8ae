"""From spec nodes to predicates for one ``(L_max, tile)``; BigBird's random draw.

Family definitions follow MASKS.md exactly:

=============  ==============================================================
dense          always
causal         ``k <= q``                        -> DiffBand(0, inf)
sliding W      ``abs(q - k) <= W``               -> DiffBand(-W, W)
global         ``q`` or ``k`` global             -> FirstGlobal / TokenGlobal
longformer     sliding(W) or global(first=G)
bigbird        block band ``abs(i-j) <= w//2``, ``i < g``, ``j < g``, random
strided s      ``q//s == k//s`` or ``k % s == s-1`` -> BlockBand(s, 0) | ColumnPeriodic
dilated W, d   ``abs(q-k) <= W`` and ``(q-k) % d == 0`` -> DiffBand(-W, W, d)
blocksparse    ``layout[q//b, k//b]``
bitmap         ``m[q, k]``
=============  ==============================================================

``causal=true`` ANDs with ``k <= q`` (folded into a DiffBand where possible).
"""

from __future__ import annotations

import numpy as np

from stofc.errors import MaskSpecError
from stofc.masks.lookup import BitmapArray, BlockLayout, RandomBlocks
from stofc.masks.parse import parse_mask
from stofc.masks.predicates import (
    BIG,
    BlockBand,
    ColumnPeriodic,
    Const,
    DiffBand,
    FirstGlobal,
    Pred,
    TokenGlobal,
)
from stofc.masks.spec import Family, MaskSpec, Node

_U64 = 1 << 64


class Combined(Pred):
    """``union`` (OR), ``intersect`` (AND), ``subtract`` (first AND NOT any other)."""

    def __init__(self, seq_len: int, tile: int, op: str, children: list[Pred]) -> None:
        super().__init__(seq_len, tile)
        self.op, self.children = op, children

    def allowed(self, q, k):
        vals = [c.allowed(q, k) for c in self.children]
        if self.op == "union":
            return np.logical_or.reduce(vals)
        if self.op == "intersect":
            return np.logical_and.reduce(vals)
        rest = np.logical_or.reduce(vals[1:]) if len(vals) > 1 else False
        return vals[0] & ~rest

    def classify(self, qlo, qhi, klo, khi):
        cls = [c.classify(qlo, qhi, klo, khi) for c in self.children]
        if self.op == "union":
            return np.maximum.reduce(cls)
        if self.op == "intersect":
            return np.minimum.reduce(cls)
        if len(cls) == 1:
            return cls[0]
        return np.minimum(cls[0], 2 - np.maximum.reduce(cls[1:])).astype(np.int8)

    def maybe_words(self, q0, k0):
        words = self.children[0].tile_words(q0, k0)
        for child in self.children[1:]:
            other = child.tile_words(q0, k0)
            if self.op == "union":
                words |= other
            elif self.op == "intersect":
                words &= other
            else:
                words &= ~other
        return words


def bigbird_random_blocks(seq_len: int, block: int, window: int, first: int, count: int,
                          seed: int) -> np.ndarray:
    """BigBird's random blocks: ``int64 [nb, count]``, each row sorted, padded with -1.

    For block row ``i >= first`` exactly ``min(count, free)`` distinct blocks are
    drawn uniformly (a partial Fisher-Yates shuffle with unbiased rejection
    sampling on raw 64-bit outputs) from the ``free`` blocks ``j < nb`` with
    ``abs(i - j) > window // 2`` and ``j >= first``. Each row uses
    ``Generator(PCG64(SeedSequence([seed, i, L_max, block, window, first])))``
    and only its raw stream, which numpy keeps stable across versions and
    machines.
    """
    nb = -(-seq_len // block)
    half = window // 2
    out = np.full((nb, count), -1, dtype=np.int64)
    if count == 0:
        return out
    for i in range(first, nb):
        n_low = max(0, i - half - first)     # j in [first, i - half - 1]
        low_start = first
        high_start = max(i + half + 1, first)
        n_high = max(0, nb - high_start)     # j in [i + half + 1, nb - 1]
        free = n_low + n_high
        take = min(count, free)
        if take == 0:
            continue
        gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
            [seed, i, seq_len, block, window, first])))
        raw = gen.bit_generator.random_raw
        swapped: dict[int, int] = {}
        picks = []
        for t in range(take):
            bound = free - t
            limit = _U64 - (_U64 % bound)
            x = int(raw())
            while x >= limit:
                x = int(raw())
            u = t + x % bound
            picks.append(swapped.get(u, u))
            swapped[u] = swapped.get(t, t)
        js = [low_start + p if p < n_low else high_start + (p - n_low) for p in picks]
        out[i, :take] = sorted(js)
    return out


def _param(node: Family, key: str) -> int:
    value = node.get(key)
    assert isinstance(value, int)
    return value


def _family(node: Family, L: int, T: int) -> Pred:
    name = node.name
    if name == "dense":
        return Const(L, T)
    if name == "causal":
        return DiffBand(L, T, 0, BIG)
    if name == "sliding":
        w = _param(node, "window")
        return DiffBand(L, T, -w, w)
    if name == "dilated":
        w = _param(node, "window")
        return DiffBand(L, T, -w, w, _param(node, "dilation"))
    if name == "global":
        tokens = node.get("tokens")
        if tokens is not None:
            return TokenGlobal(L, T, tokens)  # type: ignore[arg-type]
        return FirstGlobal(L, T, _param(node, "first"))
    if name == "longformer":
        w = _param(node, "window")
        return Combined(L, T, "union", [DiffBand(L, T, -w, w),
                                        FirstGlobal(L, T, _param(node, "global"))])
    if name == "bigbird":
        b, w, g = _param(node, "block"), _param(node, "window"), _param(node, "global")
        cols = bigbird_random_blocks(L, b, w, g, _param(node, "random"), _param(node, "seed"))
        return Combined(L, T, "union", [BlockBand(L, T, b, w // 2), FirstGlobal(L, T, g * b),
                                        RandomBlocks(L, T, b, cols)])
    if name == "strided":
        s = _param(node, "stride")
        return Combined(L, T, "union", [BlockBand(L, T, s, 0), ColumnPeriodic(L, T, s)])
    if name == "blocksparse":
        b = _param(node, "block")
        ref = node.get("layout")
        layout = ref.array  # type: ignore[union-attr]
        nb = -(-L // b)
        if layout.shape[0] < nb:
            raise MaskSpecError(f"blocksparse layout {ref.path} has {layout.shape[0]} blocks per "  # type: ignore[union-attr]
                                f"side but L_max={L} with block={b} needs {nb}",
                                hint=f"give a layout of shape [{nb}, {nb}] (or larger)")
        return BlockLayout(L, T, b, layout)
    if name == "bitmap":
        ref = node.get("file")
        arr = ref.array  # type: ignore[union-attr]
        if arr.shape[0] < L:
            raise MaskSpecError(f"bitmap file {ref.path} is {arr.shape[0]}x{arr.shape[1]} but "  # type: ignore[union-attr]
                                f"L_max={L}", hint=f"give an array of at least [{L}, {L}]")
        return BitmapArray(L, T, arr)
    raise MaskSpecError(f"unknown mask family '{name}'")  # parse_mask prevents this


def build_predicate(node: Node, seq_len: int, tile: int) -> Pred:
    """The predicate of ``node`` for ``(L_max, tile)``, with its causal modifier applied."""
    if isinstance(node, Family):
        pred = _family(node, seq_len, tile)
    else:
        pred = Combined(seq_len, tile, node.op,
                        [build_predicate(c, seq_len, tile) for c in node.children])
    if not node.causal:
        return pred
    if isinstance(pred, DiffBand):
        return DiffBand(seq_len, tile, max(pred.a, 0), pred.b, pred.d)
    return Combined(seq_len, tile, "intersect", [pred, DiffBand(seq_len, tile, 0, BIG)])


def predicate(spec: MaskSpec | str, seq_len: int, *, tile: int = 64, layer: int = 0, head: int = 0,
              num_heads: int | None = None) -> Pred:
    """The predicate of one head of one layer of a :class:`MaskSpec` (or spec text).

    ``predicate(spec, L).allowed(q, k)`` evaluates MASKS.md on broadcast int64
    position arrays (``0 <= q, k < L``).
    """
    if isinstance(spec, str):
        spec = parse_mask(spec)
    resolved = spec.for_layer(layer, num_heads)
    node = resolved.heads[0] if resolved.shared else resolved.heads[head]
    return build_predicate(node, seq_len, tile)

