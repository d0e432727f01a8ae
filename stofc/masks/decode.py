"""Reading a MaskFormat back: dense masks, statistics, and ``.npz`` files.

``save`` / ``load`` keep the canonical spec and its hash inside the file;
``load`` recomputes the hash from the stored spec, ``L_max`` and tile and
checks a digest of the arrays, so an edited or truncated file is refused.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stofc.errors import MaskSpecError
from stofc.fsutil import atomic_write_bytes
from stofc.masks.format import MaskFormat, format_hash
from stofc.masks.predicates import unpack_tiles

FORMAT_VERSION = 1
ARRAYS = ("full_row_ptr", "full_col_idx", "part_row_ptr", "part_col_idx", "part_bitmaps",
          "load_row_ptr", "load_col_idx", "load_part_idx", "row_nnz")
DENSE_LIMIT = 16384


def _check_head(fmt: MaskFormat, head: int) -> int:
    if fmt.num_heads == 1:
        return 0
    if not 0 <= head < fmt.num_heads:
        raise MaskSpecError(f"head {head} is out of range for a mask with {fmt.num_heads} heads",
                            hint=f"accepted: 0-{fmt.num_heads - 1}")
    return head


def tile_classes(fmt: MaskFormat, head: int = 0) -> np.ndarray:
    """int8 ``[R, R]`` tile map: 0 empty, 1 part, 2 full."""
    h = _check_head(fmt, head)
    R = fmt.tile_rows
    out = np.zeros((R, R), dtype=np.int8)
    for ptr, col, value in ((fmt.full_row_ptr, fmt.full_col_idx, 2),
                            (fmt.part_row_ptr, fmt.part_col_idx, 1)):
        lo, hi = ptr[h, 0], ptr[h, -1]
        rows = np.repeat(np.arange(R), np.diff(ptr[h]))
        out[rows, col[lo:hi]] = value
    return out


def to_dense(fmt: MaskFormat, head: int = 0, size: int | None = None) -> np.ndarray:
    """The bool ``[L_max, L_max]`` mask of ``head`` (any head when shared); with ``size``,
    only its top-left ``[size, size]`` corner (the mask at run length ``S = size``), decoded
    from the tiles that cover it."""
    h = _check_head(fmt, head)
    L, T = fmt.seq_len, fmt.tile
    n = L if size is None else max(0, min(int(size), L))
    if n > DENSE_LIMIT:
        raise MaskSpecError(f"a dense mask of L={n} is too large to materialise",
                            hint=f"accepted: L <= {DENSE_LIMIT}; use stats or show instead")
    R = -(-n // T)
    grid = np.zeros((R, T, R, T), dtype=bool)
    f0, f1 = fmt.full_row_ptr[h, 0], fmt.full_row_ptr[h, -1]
    frows = np.repeat(np.arange(fmt.tile_rows), np.diff(fmt.full_row_ptr[h]))
    fcols = fmt.full_col_idx[f0:f1]
    keep = (frows < R) & (fcols < R)
    grid[frows[keep], :, fcols[keep], :] = True
    p0, p1 = fmt.part_row_ptr[h, 0], fmt.part_row_ptr[h, -1]
    prows = np.repeat(np.arange(fmt.tile_rows), np.diff(fmt.part_row_ptr[h]))
    pcols = fmt.part_col_idx[p0:p1]
    (sel,) = np.nonzero((prows < R) & (pcols < R))
    step = 4096
    for s in range(0, len(sel), step):
        idx = sel[s:s + step]
        grid[prows[idx], :, pcols[idx], :] = unpack_tiles(fmt.part_bitmaps[p0 + idx], T)
    return grid.reshape(R * T, R * T)[:n, :n].copy()


def to_dense_all(fmt: MaskFormat) -> np.ndarray:
    """``[L, L]`` when shared, else ``[H, L, L]``."""
    if fmt.num_heads == 1:
        return to_dense(fmt)
    return np.stack([to_dense(fmt, h) for h in range(fmt.num_heads)])


@dataclass(frozen=True)
class MaskStats:
    """What ``stofc mask stats`` reports (totals over the format's heads)."""

    seq_len: int
    tile: int
    num_heads: int
    nnz: int
    density: float
    tiles_full: int
    tiles_part: int
    tiles_empty: int
    bitmap_bytes: int
    format_bytes: int
    blocks16_nonempty: int      # non-empty 16x16 blocks per head, max over heads (selector)
    row_tiles_max: int          # most loaded tiles in one tile row (load balance)
    row_tiles_mean: float
    row_nnz: tuple[tuple[int, ...], ...]  # allowed elements per tile row, per head

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["row_nnz"] = [list(r) for r in self.row_nnz]
        return out


def format_bytes(fmt: MaskFormat) -> int:
    return int(sum(getattr(fmt, name).nbytes for name in ARRAYS))


def blocks16_nonempty(fmt: MaskFormat) -> np.ndarray:
    """Non-empty 16x16 blocks per head (the selector's ``nnz_blocks``)."""
    T, L, R = fmt.tile, fmt.seq_len, fmt.tile_rows
    sub = T // 16
    out = np.zeros(fmt.num_heads, dtype=np.int64)
    # 16x16 blocks per tile row/column (ceil: the last tile may be short)
    nb16 = -(-(np.minimum(np.arange(R) * T + T, L) - np.arange(R) * T) // 16)
    g = T // 8
    for h in range(fmt.num_heads):
        f0, f1 = fmt.full_row_ptr[h, 0], fmt.full_row_ptr[h, -1]
        frows = np.repeat(np.arange(R), np.diff(fmt.full_row_ptr[h]))
        out[h] += int((nb16[frows] * nb16[fmt.full_col_idx[f0:f1]]).sum())
        p0, p1 = fmt.part_row_ptr[h, 0], fmt.part_row_ptr[h, -1]
        if p1 > p0:
            w = fmt.part_bitmaps[p0:p1].reshape(-1, g, g)  # [n, ic, ir]
            nz = w != 0
            blocks = nz.reshape(-1, sub, 2, sub, 2).any(axis=(2, 4))
            out[h] += int(blocks.sum())
    return out


def stats(fmt: MaskFormat) -> MaskStats:
    """Density, tile classes, sizes and per-row load of a format."""
    H, R = fmt.num_heads, fmt.tile_rows
    n_full, n_part = len(fmt.full_col_idx), len(fmt.part_col_idx)
    loads = np.diff(fmt.load_row_ptr, axis=1)
    return MaskStats(
        seq_len=fmt.seq_len, tile=fmt.tile, num_heads=H, nnz=fmt.nnz,
        density=fmt.density,
        tiles_full=n_full, tiles_part=n_part, tiles_empty=H * R * R - n_full - n_part,
        bitmap_bytes=int(fmt.part_bitmaps.nbytes), format_bytes=format_bytes(fmt),
        blocks16_nonempty=int(blocks16_nonempty(fmt).max()),
        row_tiles_max=int(loads.max()), row_tiles_mean=float(loads.mean()),
        row_nnz=tuple(tuple(int(x) for x in r) for r in fmt.row_nnz),
    )


def _arrays_digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in ARRAYS:
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def save(fmt: MaskFormat, path: str | os.PathLike) -> Path:
    """Write ``fmt`` to ``path`` (``.npz``) atomically; returns the path."""
    path = Path(path)
    arrays = {name: getattr(fmt, name) for name in ARRAYS}
    meta = {"format_version": FORMAT_VERSION, "spec": fmt.spec, "spec_hash": fmt.spec_hash,
            "seq_len": fmt.seq_len, "tile": fmt.tile, "num_heads": fmt.num_heads,
            "nnz": fmt.nnz, "arrays_sha256": _arrays_digest(arrays)}
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.array(json.dumps(meta, sort_keys=True)), **arrays)
    return atomic_write_bytes(path, buf.getvalue())


def load(path: str | os.PathLike) -> MaskFormat:
    """Read a format written by :func:`save`, checking the spec hash and array digest."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            arrays = {name: data[name] for name in ARRAYS}
    except FileNotFoundError:
        raise MaskSpecError(f"mask format file {path} does not exist") from None
    except Exception as err:
        raise MaskSpecError(f"mask format file {path} is not a stofc mask .npz "
                            f"({type(err).__name__})", hint="write it with stofc.masks.save") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise MaskSpecError(f"mask format file {path} has version {meta.get('format_version')}",
                            hint=f"accepted: {FORMAT_VERSION}; re-encode the mask")
    expected = format_hash(meta["spec"], meta["seq_len"], meta["tile"])
    if meta["spec_hash"] != expected:
        raise MaskSpecError(f"mask format file {path}: spec hash does not match its spec",
                            hint="the file was edited or corrupted; re-encode the mask")
    if _arrays_digest(arrays) != meta["arrays_sha256"]:
        raise MaskSpecError(f"mask format file {path}: arrays do not match their digest",
                            hint="the file was edited or corrupted; re-encode the mask")
    for a in arrays.values():
        a.flags.writeable = False
    return MaskFormat(spec=meta["spec"], spec_hash=meta["spec_hash"], seq_len=meta["seq_len"],
                      tile=meta["tile"], num_heads=meta["num_heads"], nnz=meta["nnz"], **arrays)
