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
from stofc.masks.cli_form import one_line
from stofc.masks.format import MaskFormat, format_hash, popcount
from stofc.masks.limits import MaskBudget, check_heads, check_seq_len
from stofc.masks.parse import parse_mask
from stofc.masks.predicates import FULL, MAYBE, ONES, pack_tiles
from stofc.masks.spec import MaskSpec, Node

TILES = (16, 32, 64, 128)
_GRID_CELLS = 1 << 15  # tile-grid cells classified per chunk (bounds temporaries)


@lru_cache(maxsize=64)
def range_words(tile: int, rows: int, cols: int) -> np.ndarray:
    """Bitmap words of a tile whose first ``rows`` x ``cols`` elements are in range."""
    ar = np.arange(tile)
    inside = (ar[:, None] < rows) & (ar[None, :] < cols)
    words = pack_tiles(inside[None])[0]
    words.flags.writeable = False
    return words


@dataclass(frozen=True)
class HeadTiles:
    """One head's tiles, row-major: per-row counts, columns, bitmaps and the load order.

    ``load_local`` is, for each loaded tile, its index among this head's part
    tiles, or -1 for a full tile.
    """

    full_counts: np.ndarray   # int64 [R]
    full_c: np.ndarray        # int32
    part_counts: np.ndarray   # int64 [R]
    part_c: np.ndarray        # int32
    words: np.ndarray         # uint64 [n_part, (T//8)**2]
    load_c: np.ndarray        # int32
    load_local: np.ndarray    # int32
    row_nnz: np.ndarray       # int64 [R]


def _cat(parts: list[np.ndarray], dtype, width: int | None = None) -> np.ndarray:
    if parts:
        return np.concatenate(parts)
    return np.zeros((0, width) if width else 0, dtype=dtype)


def encode_node(node: Node, seq_len: int, tile: int,
                budget: MaskBudget | None = None) -> HeadTiles:
    """Tiles of one node (one head) for ``(L_max, tile)``, built chunk by chunk of tile rows.

    ``budget`` is charged with each chunk's stored tiles as they are kept and stops
    the encode (a LimitError) once the format would exceed its limit.
    """
    budget = budget or MaskBudget(seq_len, tile)
    pred = build_predicate(node, seq_len, tile)
    L, T = seq_len, tile
    R = -(-L // T)
    W = (T // 8) ** 2
    starts = np.arange(R, dtype=np.int64) * T
    ends = np.minimum(starts + T, L) - 1
    sizes = ends - starts + 1
    last = int(sizes[-1])  # in-range rows/cols of the last tile row/column
    full_counts = np.zeros(R, dtype=np.int64)
    part_counts = np.zeros(R, dtype=np.int64)
    row_nnz = np.zeros(R, dtype=np.int64)
    full_c, part_c, words_all, load_c, load_local = [], [], [], [], []
    n_part = 0
    chunk = max(1, _GRID_CELLS // R)
    for r0 in range(0, R, chunk):
        r1 = min(R, r0 + chunk)
        cls = np.broadcast_to(pred.classify(starts[r0:r1, None], ends[r0:r1, None],
                                            starts[None, :], ends[None, :]), (r1 - r0, R))
        full_grid = cls == FULL
        part_grid = np.zeros_like(full_grid)
        mr, mc = np.nonzero(cls == MAYBE)
        words = np.zeros((0, W), dtype=np.uint64)
        if len(mr):
            words = pred.maybe_words(starts[mr + r0], starts[mc])
            full = np.zeros(len(mr), dtype=bool)
            edge = (mr + r0 == R - 1) | (mc == R - 1)
            inner = ~edge
            full[inner] = (words[inner] == ONES).all(axis=1)
            if edge.any():
                rows_in = np.where(mr + r0 == R - 1, last, T)
                cols_in = np.where(mc == R - 1, last, T)
                for rows, cols in set(zip(rows_in[edge].tolist(), cols_in[edge].tolist(),
                                          strict=True)):
                    sel = edge & (rows_in == rows) & (cols_in == cols)
                    rw = range_words(T, rows, cols)
                    words[sel] &= rw
                    full[sel] = (words[sel] == rw).all(axis=1)
            part = ~full & words.any(axis=1)
            full_grid[mr[full], mc[full]] = True
            part_grid[mr[part], mc[part]] = True
            words = words[part]
            if len(words):
                row_nnz[r0:r1] += np.bincount(mr[part], weights=popcount(words).sum(axis=1, dtype=np.int64),
                                              minlength=r1 - r0).astype(np.int64)
        full_counts[r0:r1] = full_grid.sum(axis=1)
        part_counts[r0:r1] = part_grid.sum(axis=1)
        budget.spend(int(full_counts[r0:r1].sum() + part_counts[r0:r1].sum()), len(words))
        row_nnz[r0:r1] += (full_grid @ sizes) * sizes[r0:r1]
        full_c.append(np.nonzero(full_grid)[1].astype(np.int32))
        part_c.append(np.nonzero(part_grid)[1].astype(np.int32))
        index = np.full(full_grid.shape, -1, dtype=np.int32)
        index[part_grid] = np.arange(n_part, n_part + len(words), dtype=np.int32)
        lr, lc = np.nonzero(full_grid | part_grid)
        load_c.append(lc.astype(np.int32))
        load_local.append(index[lr, lc])
        words_all.append(words)
        n_part += len(words)
    return HeadTiles(full_counts, _cat(full_c, np.int32), part_counts, _cat(part_c, np.int32),
                     _cat(words_all, np.uint64, W), _cat(load_c, np.int32),
                     _cat(load_local, np.int32), row_nnz)


def _row_ptr(counts: np.ndarray, offset: int) -> np.ndarray:
    ptr = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    return ptr + offset


def _frozen(a: np.ndarray, dtype) -> np.ndarray:
    out = np.ascontiguousarray(a, dtype=dtype)
    out.flags.writeable = False
    return out


def assemble(spec_text: str, seq_len: int, tile: int, heads: list[HeadTiles]) -> MaskFormat:
    """Concatenate per-head tiles into one MaskFormat with global CSR offsets."""
    fptr, pptr, lptr = [], [], []
    fcol, pcol, lcol, lpart, bitmaps = [], [], [], [], []
    nf = np_ = 0
    for h in heads:
        fptr.append(_row_ptr(h.full_counts, nf))
        pptr.append(_row_ptr(h.part_counts, np_))
        lptr.append(_row_ptr(h.full_counts + h.part_counts, nf + np_))
        fcol.append(h.full_c)
        pcol.append(h.part_c)
        lcol.append(h.load_c)
        lpart.append(np.where(h.load_local >= 0, h.load_local + np_, -1).astype(np.int32))
        bitmaps.append(h.words)
        nf += len(h.full_c)
        np_ += len(h.part_c)
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
    check_seq_len(int(seq_len), tile=tile)


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
        spec = parse_mask(spec)
    _check_geometry(seq_len, tile)
    seq_len = int(seq_len)
    if num_heads is not None:
        check_heads(num_heads)
    budget = MaskBudget(seq_len, tile)
    try:
        resolved = spec.for_layer(layer, num_heads)
        cache: dict[Node, HeadTiles] = {}
        heads = []
        for node in resolved.heads:
            if node not in cache:
                cache[node] = encode_node(node, seq_len, tile, budget)
            heads.append(cache[node])
    except MaskSpecError as err:
        raise one_line(err) from None
    return assemble(resolved.canonical(), seq_len, tile, heads)
