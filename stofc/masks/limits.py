"""Documented size limits: every request is checked against them before memory is spent.

===================  ===========  =====================================================
limit                value        what it bounds
===================  ===========  =====================================================
``MAX_SEQ_LEN``      131072       L_max of a mask (``--seq-len``) or a package
                                  (``--max-seq-len``)
``MAX_TILE_ROWS``    2048         ``ceil(L / tile)``: the tile grid is at most
                                  2048 x 2048 cells per head (so ``--tile 16``
                                  allows L <= 32768)
``MAX_HEADS``        1024         heads of a per-head mask (``--num-heads``)
``MAX_MASK_BYTES``   2 GiB        memory of one encoded mask (tile indices and 8x8
                                  bitmaps), estimated per chunk of tile rows before
                                  its bitmaps are computed
``MAX_DENSE_BYTES``  1 GiB        a dense ``[H, L, L]`` bool mask (``mask export``),
                                  checked before encoding
``MAX_PROBE_BYTES``  4 GiB        evaluating a model's own mask subgraph at one
                                  probe length S (ONNX Runtime, CPU), estimated as
                                  32 bytes x S^2 per mask value before it runs
                                  (measured: 20-24 bytes for HF BERT's mask)
``MAX_ARRAY_BYTES``  1 GiB        a ``.npy`` layout or bitmap a spec names, checked
                                  from its header before it is read
``MAX_YAML_BYTES``   1 MiB        a YAML mask file
``MAX_YAML_DEPTH``   64           nesting of YAML collections (``union`` in ``union``)
``MAX_YAML_NODES``   4096         YAML nodes after expanding aliases (an alias counts
                                  every time it is used), checked before construction
``MAX_MASK_NODES``   256          families and combinations in one spec
===================  ===========  =====================================================

A request over a limit is a :class:`~stofc.errors.LimitError` (exit 2) that
names the limit and its value.
"""

from __future__ import annotations

from stofc.errors import LimitError

GIB = 1 << 30
MAX_SEQ_LEN = 131072
MAX_TILE_ROWS = 2048
MAX_HEADS = 1024
MAX_MASK_BYTES = 2 * GIB
MAX_DENSE_BYTES = GIB
MAX_ARRAY_BYTES = GIB
MAX_PROBE_BYTES = 4 * GIB
PROBE_BYTES_PER_ELEMENT = 32  # peak bytes per S^2 element of one evaluated mask value
MAX_YAML_BYTES = 1 << 20
MAX_YAML_DEPTH = 64
MAX_YAML_NODES = 4096
MAX_MASK_NODES = 256
INDEX_BYTES_PER_TILE = 12  # col_idx + load_col_idx + load_part_idx (int32 each)


def human(size: float) -> str:
    """Bytes as ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def check_seq_len(seq_len: int, *, what: str = "sequence length", tile: int | None = None) -> None:
    """``1 <= seq_len <= MAX_SEQ_LEN`` and, with ``tile``, at most ``MAX_TILE_ROWS`` tile rows."""
    if seq_len > MAX_SEQ_LEN:
        raise LimitError(f"{what} {seq_len} is above stofc's maximum L of {MAX_SEQ_LEN}",
                         hint=f"use at most {MAX_SEQ_LEN} (stofc.masks.limits.MAX_SEQ_LEN)")
    if tile is not None and -(-seq_len // tile) > MAX_TILE_ROWS:
        raise LimitError(f"{what} {seq_len} with tile {tile} makes {-(-seq_len // tile)} tile "
                         f"rows, above the maximum of {MAX_TILE_ROWS}",
                         hint=f"use a larger --tile or L <= {MAX_TILE_ROWS * tile}")


def check_heads(num_heads: int) -> None:
    """A per-head mask has at most ``MAX_HEADS`` heads."""
    if num_heads > MAX_HEADS:
        raise LimitError(f"{num_heads} heads is above stofc's maximum of {MAX_HEADS}",
                         hint=f"use at most {MAX_HEADS} heads")


def check_dense(seq_len: int, heads: int) -> None:
    """A dense ``[heads, L, L]`` bool array fits ``MAX_DENSE_BYTES``."""
    need = seq_len * seq_len * max(1, heads)
    if need > MAX_DENSE_BYTES:
        raise LimitError(f"a dense mask of {max(1, heads)} x {seq_len} x {seq_len} needs "
                         f"{human(need)}, above the {human(MAX_DENSE_BYTES)} limit",
                         hint="export a shorter --seq-len, or use 'stofc mask encode' (the "
                              "tile format) or 'stofc mask stats'")


class MaskBudget:
    """Running estimate of one encode's memory, checked before each chunk's bitmaps."""

    def __init__(self, seq_len: int, tile: int, limit: int | None = None) -> None:
        self.seq_len, self.tile = seq_len, tile
        self.limit = MAX_MASK_BYTES if limit is None else limit
        self.bytes = 0

    def spend(self, tiles: int, bitmap_tiles: int) -> None:
        """Account for ``tiles`` stored tiles, ``bitmap_tiles`` of them with a bitmap."""
        self.bytes += tiles * INDEX_BYTES_PER_TILE + bitmap_tiles * (self.tile * self.tile // 8)
        if self.bytes > self.limit:
            raise LimitError(f"the mask at L={self.seq_len}, tile {self.tile} needs more than "
                             f"{human(self.limit)} for its tile indices and bitmaps",
                             hint="use a shorter L, a mask with fewer partial tiles, or fewer "
                                  "distinct heads (limit: stofc.masks.limits.MAX_MASK_BYTES)")
