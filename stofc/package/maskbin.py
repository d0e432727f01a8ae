"""``mask.bin``: a MaskFormat in a raw layout the custom-op library reads without numpy.

Little-endian throughout. A 128-byte header, then the MaskFormat arrays in a
fixed order, each starting at an offset that is a multiple of 8 (zero padding),
and nothing after the last one (the file ends on an 8-byte boundary)::

    offset  size  field
         0     8  magic  b"STOFMASK"
         8     4  uint32 layout version (MASK_BIN_VERSION = 1)
        12     4  uint32 header size (128)
        16     4  int32  seq_len (L_max)
        20     4  int32  tile (T)
        24     4  int32  num_heads (1 = shared by every head)
        28     4  int32  tile_rows (R = ceil(L_max / T))
        32     8  int64  n_full
        40     8  int64  n_part
        48     8  int64  nnz
        56     8  uint64 payload bytes (file size - 128)
        64    64  spec_hash, ASCII, NUL-padded
       128        full_row_ptr  int32  [num_heads, R+1]
                  full_col_idx  int32  [n_full]
                  part_row_ptr  int32  [num_heads, R+1]
                  part_col_idx  int32  [n_part]
                  part_bitmaps  uint64 [n_part, (T//8)**2]
                  load_row_ptr  int32  [num_heads, R+1]
                  load_col_idx  int32  [n_full + n_part]
                  load_part_idx int32  [n_full + n_part]
                  row_nnz       int64  [num_heads, R]

The C++ reader is ``cuda/ort/mask_file.cc``; it checks sizes, CSR bounds and
monotonicity so a damaged file is an error at session creation.
"""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path

import numpy as np

from stofc.errors import StofcError
from stofc.masks.format import MaskFormat

MASK_BIN_MAGIC = b"STOFMASK"
MASK_BIN_VERSION = 1
HEADER_BYTES = 128
_HEADER = struct.Struct("<8sIIiiiiqqqQ64s")

# (field, dtype, shape as a function of the format): the on-disk order.
_ARRAYS: tuple[tuple[str, str], ...] = (
    ("full_row_ptr", "<i4"),
    ("full_col_idx", "<i4"),
    ("part_row_ptr", "<i4"),
    ("part_col_idx", "<i4"),
    ("part_bitmaps", "<u8"),
    ("load_row_ptr", "<i4"),
    ("load_col_idx", "<i4"),
    ("load_part_idx", "<i4"),
    ("row_nnz", "<i8"),
)


def _expected_shapes(fmt: MaskFormat) -> dict[str, tuple[int, ...]]:
    h, r = fmt.num_heads, fmt.tile_rows
    n_full, n_part = len(fmt.full_col_idx), len(fmt.part_col_idx)
    words = (fmt.tile // 8) ** 2
    return {
        "full_row_ptr": (h, r + 1),
        "full_col_idx": (n_full,),
        "part_row_ptr": (h, r + 1),
        "part_col_idx": (n_part,),
        "part_bitmaps": (n_part, words),
        "load_row_ptr": (h, r + 1),
        "load_col_idx": (n_full + n_part,),
        "load_part_idx": (n_full + n_part,),
        "row_nnz": (h, r),
    }


def encode_mask_binary(fmt: MaskFormat) -> bytes:
    """The ``mask.bin`` bytes of ``fmt``; raises StofcError if an array has the wrong shape."""
    shapes = _expected_shapes(fmt)
    payload = bytearray()
    for name, dtype in _ARRAYS:
        arr = np.asarray(getattr(fmt, name))
        if arr.size != int(np.prod(shapes[name])):
            raise StofcError(
                f"MaskFormat.{name} has shape {arr.shape}, expected {shapes[name]}",
                hint="the mask encoder produced an inconsistent format; report this",
            )
        payload += b"\0" * (-len(payload) % 8)
        payload += np.ascontiguousarray(arr, dtype=dtype).tobytes()
    payload += b"\0" * (-len(payload) % 8)
    spec_hash = fmt.spec_hash.encode("ascii")[:64]
    header = _HEADER.pack(
        MASK_BIN_MAGIC, MASK_BIN_VERSION, HEADER_BYTES, fmt.seq_len, fmt.tile, fmt.num_heads,
        fmt.tile_rows, len(fmt.full_col_idx), len(fmt.part_col_idx), int(fmt.nnz), len(payload),
        spec_hash,
    )
    return header + b"\0" * (HEADER_BYTES - len(header)) + bytes(payload)


def write_mask_binary(fmt: MaskFormat, path: str | Path) -> Path:
    """Writes ``fmt`` as ``mask.bin`` at ``path`` atomically (temporary file, then rename)."""
    path = Path(path)
    data = encode_mask_binary(fmt)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_mask_binary(path: str | Path) -> MaskFormat:
    """Reads a ``mask.bin`` back (tests, ``stofc inspect``); ``spec`` is not stored and is ''."""
    data = Path(path).read_bytes()
    if len(data) < HEADER_BYTES or data[:8] != MASK_BIN_MAGIC:
        raise StofcError(f"{path} is not a stofc mask.bin", hint="rewrite the package with 'stofc compile'")
    (_, version, header, seq_len, tile, heads, rows, n_full, n_part, nnz, payload,
     spec_hash) = _HEADER.unpack_from(data)
    if version != MASK_BIN_VERSION or header != HEADER_BYTES or payload + HEADER_BYTES != len(data):
        raise StofcError(f"{path} has an unsupported or damaged layout (version {version})",
                         hint="rewrite the package with 'stofc compile'")
    words = (tile // 8) ** 2
    counts = {
        "full_row_ptr": heads * (rows + 1), "full_col_idx": n_full,
        "part_row_ptr": heads * (rows + 1), "part_col_idx": n_part,
        "part_bitmaps": n_part * words, "load_row_ptr": heads * (rows + 1),
        "load_col_idx": n_full + n_part, "load_part_idx": n_full + n_part, "row_nnz": heads * rows,
    }
    shapes = {"full_row_ptr": (heads, rows + 1), "part_row_ptr": (heads, rows + 1),
              "load_row_ptr": (heads, rows + 1), "part_bitmaps": (n_part, words),
              "row_nnz": (heads, rows)}
    pos, arrays = HEADER_BYTES, {}
    for name, dtype in _ARRAYS:
        pos += -pos % 8
        arr = np.frombuffer(data, dtype=dtype, count=counts[name], offset=pos)
        pos += arr.nbytes
        arr = arr.astype(dtype[1:]).reshape(shapes.get(name, (counts[name],)))
        arr.flags.writeable = False
        arrays[name] = arr
    return MaskFormat(spec="", spec_hash=spec_hash.rstrip(b"\0").decode("ascii"), seq_len=seq_len,
                      tile=tile, num_heads=heads, nnz=nnz, **arrays)
