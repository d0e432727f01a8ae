"""The unified sparse mask format (STOF): outer-tile CSR plus 8x8 inner-tile bitmaps.

This dataclass is the contract between the mask encoder (``stofc.masks``), the
attention kernels (``stofc.kernels.attention``), the package writer and the
custom-op library. Its fields and their meaning are frozen; add fields, never
change one.

Geometry. ``seq_len`` is ``L_max``; ``tile`` is the outer tile size ``T``
(16, 32, 64 or 128); ``R = ceil(L_max / T)`` tile rows and tile columns. An
outer tile (OT) ``(r, c)`` covers queries ``r*T .. r*T+T-1`` and keys
``c*T .. c*T+T-1``; positions at or past ``L_max`` are outside the mask.

Classes of an OT: *full* when every in-range element is allowed, *part* when
some but not all are, *empty* (not stored) when none is.

Per-head formats. ``num_heads`` is 1 when every head shares the mask, else the
number of heads ``H``. Every ``*_row_ptr`` array has shape ``[num_heads, R+1]``
and holds *global* offsets into the flat column arrays, so head ``h``, tile
row ``r`` spans ``col_idx[row_ptr[h, r] : row_ptr[h, r+1]]``. Columns within a
row are sorted ascending.

Bitmaps. Each part OT owns ``(T//8)**2`` ``uint64`` words, one per 8x8 inner
tile (IT). ITs are stored column-major inside the OT: the word for IT row
``ir`` and IT column ``ic`` is ``part_bitmaps[p, ic * (T//8) + ir]``. Inside a
word, bit ``r * 8 + c`` is element row ``r``, column ``c`` of the IT. Bits of
out-of-range positions are 0.

Load list. ``load_*`` is the CSR of the union of full and part OTs (what the
block-wise kernel walks); ``load_part_idx[j]`` is the row of
``part_bitmaps`` for a part tile and -1 for a full tile.

Spec and hash (as ``stofc.masks.encode`` fills them). ``spec`` is the
canonical JSON (sorted keys, no whitespace) of the resolved layer:
``{"mask": NODE}`` when every head shares it, ``{"heads": [NODE, ...]}``
otherwise; ``spec_hash`` is the sha256 hex of the canonical JSON of
``{"seq_len": L_max, "spec": spec, "tile": T}``. ``stofc.masks.save`` /
``load`` keep both in a ``.npz`` and check them on load. Decoding (dense views,
statistics) is :mod:`stofc.masks.decode`'s.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from stofc.masks.spec import canonical_json, sha256_text


@dataclass(frozen=True, eq=False)
class MaskFormat:
    """A mask encoded for one ``(spec, L_max, tile)``; arrays are read-only numpy."""

    spec: str                   # canonical spec (JSON text) the format was built from
    spec_hash: str              # sha256 hex of the canonical spec, L_max and tile
    seq_len: int                # L_max
    tile: int                   # outer tile size T
    num_heads: int              # 1 = shared by all heads, else H
    full_row_ptr: np.ndarray    # int32 [num_heads, R+1]
    full_col_idx: np.ndarray    # int32 [n_full]
    part_row_ptr: np.ndarray    # int32 [num_heads, R+1]
    part_col_idx: np.ndarray    # int32 [n_part]
    part_bitmaps: np.ndarray    # uint64 [n_part, (T//8)**2], ITs column-major
    load_row_ptr: np.ndarray    # int32 [num_heads, R+1]
    load_col_idx: np.ndarray    # int32 [n_full + n_part]
    load_part_idx: np.ndarray   # int32 [n_full + n_part], -1 for full tiles
    row_nnz: np.ndarray         # int64 [num_heads, R]: allowed elements per tile row
    nnz: int                    # allowed elements, summed over the format's heads

    @property
    def tile_rows(self) -> int:
        """``R = ceil(L_max / T)``."""
        return -(-self.seq_len // self.tile)

    @property
    def density(self) -> float:
        """Allowed elements over ``num_heads * L_max**2``."""
        return self.nnz / (self.num_heads * self.seq_len * self.seq_len)


def popcount(words: np.ndarray) -> np.ndarray:
    """Set bits per uint64 (uint8 result, same shape; sum with ``dtype=np.int64``)."""
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(words)
    lut = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)
    raw = np.ascontiguousarray(words).view(np.uint8).reshape(*words.shape, 8)
    return lut[raw].sum(axis=-1, dtype=np.uint8)


def content_digest(fmt: MaskFormat) -> str:
    """sha256 hex of everything a format holds (geometry, every array): equal digests mean
    equal masks, whatever built them; the key of memoised choices made on a format."""
    h = hashlib.sha256(f"{fmt.seq_len}:{fmt.tile}:{fmt.num_heads}:{fmt.nnz}".encode())
    for arr in (fmt.full_row_ptr, fmt.full_col_idx, fmt.part_row_ptr, fmt.part_col_idx,
                fmt.part_bitmaps, fmt.load_row_ptr, fmt.load_col_idx, fmt.load_part_idx,
                fmt.row_nnz):
        a = np.ascontiguousarray(arr)
        h.update(f"|{a.dtype.str}{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def format_hash(spec_text: str, seq_len: int, tile: int) -> str:
    """``MaskFormat.spec_hash``: sha256 of the canonical JSON of spec, L_max and tile."""
    return sha256_text(canonical_json({"spec": spec_text, "seq_len": seq_len, "tile": tile}))
