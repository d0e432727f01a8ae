"""Encode a mask spec into the unified format (:class:`~stofc.masks.format.MaskFormat`).

Per head, per chunk of tile rows: classify every outer tile from the
predicate's tile-level bounds (no element work for tiles known full or
empty), compute 8x8 bitmaps only for the uncertain tiles (sharing identical
ones), mask positions past ``L_max``, then reclassify those tiles from their
bits. Memory stays within a chunk of the tile grid plus the format itself;
no ``L x L`` array is ever built. The result is a pure function of
``(canonical spec, L_max, tile)``: byte-identical on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from stofc.errors import MaskSpecError
from stofc.masks.build import build_predicate
from stofc.masks.format import MaskFormat
from stofc.masks.predicates import FULL, MAYBE, ONES, pack_tiles
from stofc.masks.spec import MaskSpec, Node, canonical_json, sha256_text

TILES = (16, 32, 64, 128)
_GRID_CELLS = 1 << 20  # tile-grid cells classified per chunk


def popcount(words: np.ndarray) -> np.ndarray:
    """Set bits per uint64 (int64 result, same shape)."""
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(words).astype(np.int64)
    lut = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)
    raw = np.ascontiguousarray(words).view(np.uint8).reshape(*words.shape, 8)
    return lut[raw].sum(axis=-1)


@lru_cache(maxsize=64)
def range_words(tile: int, rows: int, cols: int) -> np.ndarray:
    """Bitmap words of a tile whose first ``rows`` x ``cols`` elements are in range."""
    ar = np.arange(tile)
    inside = (ar[:, None] < rows) & (ar[None, :] < cols)
    words = pack_tiles(inside[None])[0]
    words.flags.writeable = False
    return words


def format_hash(spec_text: str, seq_len: int, tile: int) -> str:
    """``MaskFormat.spec_hash``: sha256 of the canonical JSON of spec, L_max and tile."""
    return sha256_text(canonical_json({"spec": spec_text, "seq_len": seq_len, "tile": tile}))


@dataclass(frozen=True)
class HeadTiles:
    """One head's tiles: full and part coordinates (row-major sorted), bitmaps, row counts."""

    full_r: np.ndarray
    full_c: np.ndarray
    part_r: np.ndarray
    part_c: np.ndarray
    words: np.ndarray
    row_nnz: np.ndarray


def encode_node(node: Node, seq_len: int, tile: int) -> HeadTiles:
    """Tiles of one node (one head) for ``(L_max, tile)``."""
    pred = build_predicate(node, seq_len, tile)
    L, T = seq_len, tile
    R = -(-L // T)
    starts = np.arange(R, dtype=np.int64) * T
    ends = np.minimum(starts + T, L) - 1
    last = L - starts[-1]  # in-range rows/cols of the last tile row/column
    full_r, full_c, part_r, part_c, words_all = [], [], [], [], []
    chunk = max(1, _GRID_CELLS // R)
    for r0 in range(0, R, chunk):
        r1 = min(R, r0 + chunk)
        cls = np.broadcast_to(pred.classify(starts[r0:r1, None], ends[r0:r1, None],
                                            starts[None, :], ends[None, :]), (r1 - r0, R))
        fr, fc = np.nonzero(cls == FULL)
        full_r.append(fr + r0)
        full_c.append(fc)
        mr, mc = np.nonzero(cls == MAYBE)
        if not len(mr):
            continue
        mr += r0
        words = pred.maybe_words(starts[mr], starts[mc])
        full = np.zeros(len(mr), dtype=bool)
        edge = (mr == R - 1) | (mc == R - 1)
        inner = ~edge
        full[inner] = (words[inner] == ONES).all(axis=1)
        if edge.any():
            for rows, cols in {(int(last if r == R - 1 else T), int(last if c == R - 1 else T))
                               for r, c in zip(mr[edge], mc[edge], strict=True)}:
                sel = edge & (np.where(mr == R - 1, last, T) == rows) \
                    & (np.where(mc == R - 1, last, T) == cols)
                rw = range_words(T, rows, cols)
                words[sel] &= rw
                full[sel] = (words[sel] == rw).all(axis=1)
        empty = ~words.any(axis=1)
        part = ~full & ~empty
        full_r.append(mr[full])
        full_c.append(mc[full])
        part_r.append(mr[part])
        part_c.append(mc[part])
        words_all.append(words[part])
    fr = np.concatenate(full_r).astype(np.int64)
    fc = np.concatenate(full_c).astype(np.int64)
    order = np.lexsort((fc, fr))
    fr, fc = fr[order], fc[order]
    pr = np.concatenate(part_r).astype(np.int64) if part_r else np.zeros(0, np.int64)
    pc = np.concatenate(part_c).astype(np.int64) if part_c else np.zeros(0, np.int64)
    words = (np.concatenate(words_all) if words_all
             else np.zeros((0, (T // 8) ** 2), dtype=np.uint64))
    sizes = np.minimum(starts + T, L) - starts
    row_nnz = np.bincount(fr, weights=sizes[fr] * sizes[fc], minlength=R)
    row_nnz = np.rint(row_nnz).astype(np.int64)
    if len(pr):
        row_nnz += np.bincount(pr, weights=popcount(words).sum(axis=1), minlength=R).astype(
            np.int64)
    return HeadTiles(fr, fc, pr, pc, words, row_nnz)


def _row_ptr(rows: np.ndarray, R: int, offset: int) -> np.ndarray:
    ptr = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=R), out=ptr[1:])
    return ptr + offset


def _frozen(a: np.ndarray, dtype) -> np.ndarray:
    out = np.ascontiguousarray(a, dtype=dtype)
    out.flags.writeable = False
    return out


def assemble(spec_text: str, seq_len: int, tile: int, heads: list[HeadTiles]) -> MaskFormat:
    """Concatenate per-head tiles into one MaskFormat with global CSR offsets."""
    R = -(-seq_len // tile)
    fptr, pptr, lptr = [], [], []
    fcol, pcol, lcol, lpart, bitmaps = [], [], [], [], []
    nf = np_ = 0
    for h in heads:
        fptr.append(_row_ptr(h.full_r, R, nf))
        pptr.append(_row_ptr(h.part_r, R, np_))
        lptr.append(_row_ptr(np.concatenate([h.full_r, h.part_r]), R, nf + np_))
        rows = np.concatenate([h.full_r, h.part_r])
        cols = np.concatenate([h.full_c, h.part_c])
        pidx = np.concatenate([np.full(len(h.full_r), -1, np.int64),
                               np.arange(len(h.part_r), dtype=np.int64) + np_])
        order = np.lexsort((cols, rows))
        fcol.append(h.full_c)
        pcol.append(h.part_c)
        lcol.append(cols[order])
        lpart.append(pidx[order])
        bitmaps.append(h.words)
        nf += len(h.full_r)
        np_ += len(h.part_r)
    row_nnz = np.stack([h.row_nnz for h in heads])
    i32 = np.int32
    return MaskFormat(
        spec=spec_text,
        spec_hash=format_hash(spec_text, seq_len, tile),
        seq_len=seq_len,
        tile=tile,
        num_heads=len(heads),
        full_row_ptr=_frozen(np.stack(fptr), i32),
        full_col_idx=_frozen(np.concatenate(fcol), i32),
        part_row_ptr=_frozen(np.stack(pptr), i32),
        part_col_idx=_frozen(np.concatenate(pcol), i32),
        part_bitmaps=_frozen(np.concatenate(bitmaps).reshape(-1, (tile // 8) ** 2), np.uint64),
        load_row_ptr=_frozen(np.stack(lptr), i32),
        load_col_idx=_frozen(np.concatenate(lcol), i32),
        load_part_idx=_frozen(np.concatenate(lpart), i32),
        row_nnz=_frozen(row_nnz, np.int64),
        nnz=int(row_nnz.sum()),
    )


def _check_geometry(seq_len: int, tile: int) -> None:
    if tile not in TILES:
        raise MaskSpecError(f"tile size {tile} is not supported",
                            hint=f"accepted: {', '.join(map(str, TILES))}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise MaskSpecError(f"sequence length {seq_len!r} is invalid",
                            hint="accepted: an integer >= 1")
    if seq_len > 1 << 24:
        raise MaskSpecError(f"sequence length {seq_len} is too large",
                            hint="accepted: at most 16777216")


def encode(spec: MaskSpec | str, seq_len: int, *, tile: int = 64, layer: int = 0,
           num_heads: int | None = None) -> MaskFormat:
    """Encode ``spec`` for ``L_max = seq_len`` and outer tile ``tile``.

    A spec whose heads differ (head overrides, per-head files) needs
    ``num_heads`` (per-head files imply it) and yields ``num_heads = H``; a
    spec whose heads all resolve to one mask yields ``num_heads = 1``.
    ``MaskFormat.spec`` is the canonical JSON of the resolved layer
    (``{"mask": ...}`` or ``{"heads": [...]}``), so layers that resolve alike
    share one format.
    """
    if isinstance(spec, str):
        from stofc.masks.parse import parse_mask

        spec = parse_mask(spec)
    _check_geometry(seq_len, tile)
    seq_len = int(seq_len)
    resolved = spec.for_layer(layer, num_heads)
    cache: dict[Node, HeadTiles] = {}
    heads = []
    for node in resolved.heads:
        if node not in cache:
            cache[node] = encode_node(node, seq_len, tile)
        heads.append(cache[node])
    return assemble(resolved.canonical(), seq_len, tile, heads)
