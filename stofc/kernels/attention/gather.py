"""The block-wise kernel's walk list, with sparse-column tiles gathered together.

A part tile whose allowed elements sit in few key columns (strided masks' one
column per stride, dilation's every other column, global columns) wastes most
of its ``T x T`` tensor-core work. :func:`plan_tiles` packs the occupied key
columns of such tiles of one tile row into *gathered tiles* of ``T`` key slots:
the kernel loads K/V rows by key index (``gather_keys``) and applies a bitmap
built for the gathered columns. Every allowed ``(q, k)`` lands in exactly one
walked tile, so the result is unchanged; only the zeros are skipped.

Walk list per (head, tile row): gathered tiles first (``key_base < 0`` means
gathered tile ``-key_base - 1``), then the untouched tiles in ascending key
order (``key_base = c * T``), so the kernel can drop trailing tiles past the
runtime key length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stofc.masks.format import MaskFormat

GATHER_MAX_FRACTION = 0.5   # a part tile is a candidate when <= T/2 of its columns hold bits


@dataclass(frozen=True, eq=False)
class TilePlan:
    """What the block-wise kernel walks (see the module docstring)."""

    tile: int
    num_heads: int
    row_ptr: np.ndarray       # int32 [num_heads, R+1], global offsets
    key_base: np.ndarray      # int32 [n]: c*T, or -(g+1) for gathered tile g
    part_idx: np.ndarray      # int32 [n]: row of ``bitmaps``, -1 for full tiles
    bitmaps: np.ndarray       # uint64 [P, (T//8)**2], ITs column-major
    gather_keys: np.ndarray   # int32 [G, T]: key per slot, -1 = empty slot
    tiles_per_row: np.ndarray  # int64 [num_heads, R]

    @property
    def gathered(self) -> int:
        return int(self.gather_keys.shape[0])


def unpack_bits(words: np.ndarray, tile: int) -> np.ndarray:
    """uint64 ``[n, (T/8)^2]`` (ITs column-major) -> bool ``[n, T, T]`` (row, col)."""
    n, g = words.shape[0], tile // 8
    raw = np.ascontiguousarray(words, dtype="<u8").view(np.uint8).reshape(n, g, g, 8)  # p,ic,ir,rr
    bits = np.unpackbits(raw, axis=-1, bitorder="little").reshape(n, g, g, 8, 8)      # p,ic,ir,rr,cc
    return bits.transpose(0, 2, 3, 1, 4).reshape(n, tile, tile).astype(bool)


def pack_bits(bits: np.ndarray) -> np.ndarray:
    """Inverse of :func:`unpack_bits`."""
    n, t, _ = bits.shape
    g = t // 8
    x = bits.reshape(n, g, 8, g, 8).transpose(0, 3, 1, 2, 4)                            # p,ic,ir,rr,cc
    packed = np.packbits(x.reshape(n, g, g, 64), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u8").reshape(n, g * g).astype(np.uint64)


def column_occupancy(words: np.ndarray, tile: int) -> np.ndarray:
    """bool ``[n, T]``: which key columns of each part tile hold any allowed bit."""
    n, g = words.shape[0], tile // 8
    w = np.bitwise_or.reduce(np.asarray(words).reshape(n, g, g), axis=2)               # p,ic
    cols = np.bitwise_or.reduce(w.astype("<u8").view(np.uint8).reshape(n, g, 8), axis=2)
    return np.unpackbits(cols[..., None], axis=-1, bitorder="little").reshape(n, tile).astype(bool)


def plan_tiles(fmt: MaskFormat, *, gather: bool = True,
               max_fraction: float = GATHER_MAX_FRACTION) -> TilePlan:
    """The walk list of ``fmt``; with ``gather``, sparse-column part tiles are packed."""
    t, heads, rows = fmt.tile, fmt.num_heads, fmt.tile_rows
    ptr = np.asarray(fmt.load_row_ptr, dtype=np.int64)
    cols = np.asarray(fmt.load_col_idx, dtype=np.int64)
    parts = np.asarray(fmt.load_part_idx, dtype=np.int64)
    words = np.asarray(fmt.part_bitmaps, dtype=np.uint64).reshape(-1, (t // 8) ** 2)
    occ = column_occupancy(words, t) if gather and words.size else np.zeros((len(words), t), bool)
    occ_n = occ.sum(axis=1)
    key_base: list[np.ndarray] = []
    part_idx: list[np.ndarray] = []
    new_bitmaps: list[np.ndarray] = []
    gather_keys: list[np.ndarray] = []
    row_ptr = np.zeros((heads, rows + 1), dtype=np.int64)
    n_out = 0
    for h in range(heads):
        for r in range(rows):
            j0, j1 = ptr[h, r], ptr[h, r + 1]
            c, p = cols[j0:j1], parts[j0:j1]
            cand = np.zeros(len(c), dtype=bool)
            if gather and len(c):
                is_part = p >= 0
                cand[is_part] = occ_n[p[is_part]] <= max_fraction * t
                n_cols = int(occ_n[p[cand]].sum())
                if cand.sum() < 2 or -(-n_cols // t) >= cand.sum():
                    cand[:] = False
            if cand.any():
                src = p[cand]
                bits = unpack_bits(words[src], t)                       # [k, T, T]
                sel = occ[src]                                          # [k, T]
                which, lc = np.nonzero(sel)                             # sorted by tile, column
                keys = c[cand][which] * t + lc
                colbits = bits[which, :, lc]                            # [n_cols, T rows]
                n_g = -(-len(keys) // t)
                slots = np.full(n_g * t, -1, dtype=np.int64)
                slots[:len(keys)] = keys
                flat = np.zeros((n_g * t, t), dtype=bool)
                flat[:len(keys)] = colbits
                gbits = flat.reshape(n_g, t, t).transpose(0, 2, 1)     # [g, rows, slots]
                base = len(gather_keys)
                gather_keys.extend(slots.reshape(n_g, t))
                new_bitmaps.append(pack_bits(gbits))
                first_new = len(words) + sum(len(b) for b in new_bitmaps[:-1])
                key_base.append(-(np.arange(n_g) + base + 1))
                part_idx.append(first_new + np.arange(n_g))
                n_out += n_g
            keep = ~cand
            key_base.append(c[keep] * t)
            part_idx.append(p[keep])
            n_out += int(keep.sum())
            row_ptr[h, r + 1] = n_out
        if h + 1 < heads:
            row_ptr[h + 1, 0] = n_out
    all_bitmaps = np.concatenate([words, *new_bitmaps]) if new_bitmaps else words
    gk = np.stack(gather_keys) if gather_keys else np.zeros((0, t), dtype=np.int64)
    kb = np.concatenate(key_base) if key_base else np.zeros(0, dtype=np.int64)
    pi = np.concatenate(part_idx) if part_idx else np.zeros(0, dtype=np.int64)
    per_row = (row_ptr[:, 1:] - row_ptr[:, :-1]).astype(np.int64)
    return TilePlan(t, heads, row_ptr.astype(np.int32), kb.astype(np.int32), pi.astype(np.int32),
                    np.ascontiguousarray(all_bitmaps, dtype=np.uint64), gk.astype(np.int32),
                    per_row)


def plan_to_dense(plan: TilePlan, seq_len: int) -> np.ndarray:
    """The bool ``[num_heads, L, L]`` mask a plan walks (test oracle: equals the format's)."""
    t = plan.tile
    rows = plan.row_ptr.shape[1] - 1
    out = np.zeros((plan.num_heads, rows * t, rows * t + t), dtype=bool)
    for h in range(plan.num_heads):
        for r in range(rows):
            for j in range(plan.row_ptr[h, r], plan.row_ptr[h, r + 1]):
                kb, p = int(plan.key_base[j]), int(plan.part_idx[j])
                bits = np.ones((t, t), bool) if p < 0 else unpack_bits(plan.bitmaps[p:p + 1], t)[0]
                if kb >= 0:
                    out[h, r * t:(r + 1) * t, kb:kb + t] |= bits
                else:
                    keys = plan.gather_keys[-kb - 1]
                    for s in np.nonzero(keys >= 0)[0]:
                        out[h, r * t:(r + 1) * t, keys[s]] |= bits[:, s]
    return out[:, :seq_len, :seq_len]
