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
from typing import Any

import numpy as np

from stofc.errors import StofcError
from stofc.kernels.attention.config import attention_families, attention_family
from stofc.kernels.attention.launch import LaunchData
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
    return _write_atomic(Path(path), encode_mask_binary(fmt))


def _write_atomic(path: Path, data: bytes) -> Path:
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


# ---------------------------------------------------------------- attention launch plans
#
# ``*.plan.bin``: the device arrays the attention kernel of one (mask format, config) is
# launched with: the family's launch data (:func:`stofc.kernels.attention.launch.launch_data`,
# which the CuPy runtime uploads too), so the C++ CUDA twin only uploads and indexes them.
# Kinds 0 (block-wise) and 1 (row-wise): the walk list (maybe gathered or residue-permuted),
# the sentinels and the longest-first tile-row orders
# (:class:`~stofc.kernels.attention.launch.AttentionLaunchData`); kind 2 (warp-specialised):
# the pair-row walk, work items, orders and combine table
# (:class:`~stofc.kernels.attention.ws_launch.WsLaunchPlan`). The kind is the family's
# ``plan_code``; its launch data class names the arrays and scalars. One layout for every
# kind (little-endian; arrays 8-byte aligned, zero padding, file ends 8-aligned)::
#
#    offset size field
#         0    8 magic b"STOFAPLN"
#         8    4 uint32 layout version (PLAN_BIN_VERSION = 7)
#        12    4 uint32 header size (PLAN_HEADER_BYTES = 256)
#        16    4 int32  kind (0 block-wise, 1 row-wise, 2 warp-specialised)
#        20    4 int32  tile T
#        24    4 int32  tile_rows R
#        28    4 int32  seq_len L_max
#        32    4 int32  mask heads (the format's num_heads; 1 = shared)
#        36    4 int32  n: number of arrays (7 block/row, 8 ws)
#        40   32 int32[8] kind scalars (zero past the kind's):
#                  block/row: permuted (0/1), fmt_head_stride (0 = shared mask, else R+1)
#                  ws: pairs, slots, n_items, n_split, split, orders_per_head, consumers,
#                      period (the residue split: 1, 2 or 4)
#        72   32 spec_hash of the mask, ASCII, NUL-padded (truncated to 32)
#       104   24 zero
#       128  128 int64[16] element counts of the n arrays (zero past n)
#       256      the arrays, in order:
#                  block/row: row_ptr int32, col_idx int32 (+1 sentinel 0), part_idx int32
#                  (+1 sentinel -1), bitmaps uint64 (>= 2 words), gather_keys int32 (+4 x -1),
#                  q_perm int32 [R*T + 4] (-1 = none), row_orders int32 (rows = 1..R
#                  concatenated: rows r starts at r*(r-1)/2)
#                  ws: entry_key int32 (+1 sentinel 0), entry_part int32 (consumers per
#                  entry, + consumers sentinels -2), bitmaps uint64 (>= 2 words; fragment order,
#                  ws_plan.fragment_bitmaps), items int32 [heads, n_items, 5],
#                  orders int32 [heads, orders_per_head], combine int32 [heads, n_split, 3],
#                  order_ptr int32 [pairs + 1], items_upto int32 [pairs + 1]

PLAN_BIN_MAGIC = b"STOFAPLN"
# 7: a ws plan's bitmaps are in fragment order (ws_plan.fragment_bitmaps; 6: the format's);
# 6: a ws item's ``shared`` is 1 + w0 (5: 1 + w0 + consumers x the first scratch slot)
PLAN_BIN_VERSION = 7
PLAN_HEADER_BYTES = 256
_PLAN_HEADER = struct.Struct("<8sIIiiiiii8i32s")
_PLAN_COUNTS = struct.Struct("<16q")
_COUNTS_AT = 128


def encode_attention_plan(data: LaunchData) -> bytes:
    """The ``*.plan.bin`` bytes of ``data`` (any kind's, see the layout above)."""
    arrays = data.ARRAYS
    payload = bytearray()
    for name, dtype in arrays:
        payload += b"\0" * (-len(payload) % 8)
        payload += np.ascontiguousarray(getattr(data, name), dtype=dtype).tobytes()
    payload += b"\0" * (-len(payload) % 8)
    scalars = list(data.scalars()) + [0] * (8 - len(data.scalars()))
    counts = [int(np.asarray(getattr(data, n)).size) for n, _ in arrays]
    header = _PLAN_HEADER.pack(
        PLAN_BIN_MAGIC, PLAN_BIN_VERSION, PLAN_HEADER_BYTES,
        attention_family(data.kind).plan_code, data.tile, data.tile_rows, data.seq_len,
        data.heads, len(arrays), *scalars, data.spec_hash.encode("ascii")[:32])
    header += b"\0" * (_COUNTS_AT - len(header))
    header += _PLAN_COUNTS.pack(*counts, *[0] * (16 - len(counts)))
    return header + bytes(payload)


def write_attention_plan(data: LaunchData, path: str | Path) -> Path:
    """Writes ``data`` as ``*.plan.bin`` at ``path`` atomically."""
    return _write_atomic(Path(path), encode_attention_plan(data))


def read_attention_plan(path: str | Path) -> LaunchData:
    """Reads a ``*.plan.bin`` back (tests, ``stofc inspect``): the kind's family's launch
    data class."""
    data = Path(path).read_bytes()
    if len(data) < PLAN_HEADER_BYTES or data[:8] != PLAN_BIN_MAGIC:
        raise StofcError(f"{path} is not a stofc attention plan",
                         hint="rewrite the package with 'stofc compile'")
    (_, version, header, kind, tile, rows, seq_len, heads, n, *rest) = \
        _PLAN_HEADER.unpack_from(data)
    scalars, spec_hash = rest[:8], rest[8].rstrip(b"\0").decode("ascii")
    family = next((f for f in attention_families() if f.plan_code == kind), None)
    if version != PLAN_BIN_VERSION or header != PLAN_HEADER_BYTES or family is None:
        raise StofcError(f"{path} has an unsupported layout (version {version}, kind {kind})",
                         hint="rewrite the package with 'stofc compile'")
    layout = family.launch_data_type
    if n != len(layout.ARRAYS):
        raise StofcError(f"{path} holds {n} arrays, a {family.kind} plan "
                         f"{len(layout.ARRAYS)}", hint="rewrite the package with 'stofc compile'")
    counts = _PLAN_COUNTS.unpack_from(data, _COUNTS_AT)[:n]
    pos = PLAN_HEADER_BYTES
    arrays: dict[str, Any] = {}
    for (name, dtype), count in zip(layout.ARRAYS, counts, strict=True):
        pos += -pos % 8
        arrays[name] = np.frombuffer(data, dtype=dtype, count=count, offset=pos).astype(dtype[1:])
        pos += arrays[name].nbytes
    common = dict(kind=family.kind, tile=tile, tile_rows=rows, seq_len=seq_len,
                  spec_hash=spec_hash, **arrays)
    return layout.from_plan_file(common, heads, dict(zip(layout.SCALARS, scalars, strict=False)))
