"""The launch data of an attention kernel: computed once, here, for every user.

:func:`launch_data` gives the arrays and scalars one attention kernel of a (mask
format, config) pair is launched with: the walk list (the block-wise kernel's,
maybe gathered or residue-permuted, :mod:`.gather` / :mod:`.permute`; the row-wise
kernel walks the format itself), the sentinels the kernels read past the end, the
query permutation and, per run length, the tile-row order (longest rows first, so
the long rows start in the first wave). The CuPy runtime
(:class:`stofc.runtime.attention.AttentionOp`) uploads exactly these; the package
writes them as ``*.plan.bin`` (:mod:`stofc.package.maskbin`) for the CUDA twin,
which only uploads and indexes them. No GPU is touched here.

A kernel form with another walk has its own launch data class (the warp-specialised
kernel's :class:`~stofc.kernels.attention.ws_launch.WsLaunchPlan`): a :class:`LaunchData`
naming its arrays and header scalars, in plan-file order, which is all the plan file's
writer and reader need.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from stofc.kernels.attention.config import AttentionConfig, attention_family
from stofc.kernels.attention.gather import TilePlan
from stofc.masks.format import MaskFormat


class LaunchData:
    """What every attention kernel's launch data has for its ``*.plan.bin``: the
    arrays (name, little-endian dtype) and the header's kind scalars, in file order,
    the mask format's heads, and the constructor from a file's fields."""

    ARRAYS: ClassVar[tuple[tuple[str, str], ...]]
    SCALARS: ClassVar[tuple[str, ...]]
    kind: str
    tile: int
    tile_rows: int
    seq_len: int
    spec_hash: str

    @property
    def heads(self) -> int:
        """The mask format's heads (1: shared by every head)."""
        raise NotImplementedError

    def scalars(self) -> tuple[int, ...]:
        """The header's kind scalars (:attr:`SCALARS`)."""
        return tuple(int(getattr(self, name)) for name in self.SCALARS)

    @classmethod
    def from_plan_file(cls, common: Mapping[str, Any], heads: int,
                       scalars: Mapping[str, int]) -> LaunchData:
        """The data a plan file holds: ``common`` (kind, tile, tile_rows, seq_len,
        spec_hash and the arrays), the header's heads and kind scalars."""
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class AttentionLaunchData(LaunchData):
    """The uploaded arrays and scalars of one block- or row-wise kernel (module doc).

    ``plan`` is the block-wise walk list (None for the row-wise kernel, which walks the
    format); ``permutation`` the residue permutation of queries and keys, if any.
    """

    ARRAYS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("row_ptr", "<i4"), ("col_idx", "<i4"), ("part_idx", "<i4"), ("bitmaps", "<u8"),
        ("gather_keys", "<i4"), ("q_perm", "<i4"), ("row_orders", "<i4"))
    SCALARS: ClassVar[tuple[str, ...]] = ("permuted", "fmt_head_stride")

    kind: str
    tile: int
    tile_rows: int
    seq_len: int
    permuted: bool
    fmt_head_stride: int
    spec_hash: str
    row_ptr: np.ndarray
    col_idx: np.ndarray
    part_idx: np.ndarray
    bitmaps: np.ndarray
    gather_keys: np.ndarray
    q_perm: np.ndarray
    row_orders: np.ndarray
    plan: TilePlan | None = None
    permutation: np.ndarray | None = None

    @property
    def heads(self) -> int:
        return 1 if self.fmt_head_stride == 0 else self.row_ptr.size // (self.tile_rows + 1)

    @classmethod
    def from_plan_file(cls, common: Mapping[str, Any], heads: int,
                       scalars: Mapping[str, int]) -> AttentionLaunchData:
        return cls(permuted=bool(scalars["permuted"]),
                   fmt_head_stride=int(scalars["fmt_head_stride"]), **common)

    def rows(self, seq_len: int) -> int:
        """Tile rows a run of ``seq_len`` launches (all of them when permuted: permuted
        rows mix every position)."""
        return self.tile_rows if self.permuted else -(-seq_len // self.tile)

    def order(self, seq_len: int) -> np.ndarray:
        """The tile-row order a run of ``seq_len`` launches with (longest first)."""
        rows = self.rows(seq_len)
        start = rows * (rows - 1) // 2
        return self.row_orders[start:start + rows]


@dataclass(frozen=True, eq=False)
class Walk:
    """What a family's kernel walks: CSR row pointers, per entry the key base (or gathered
    tile) and bitmap row, the bitmaps, the gathered tiles' keys and the work per
    (head, tile row) that orders the rows; the block-wise walk list and permutation."""

    row_ptr: np.ndarray
    keys: np.ndarray
    parts: np.ndarray
    words: np.ndarray
    gather_keys: np.ndarray
    work: np.ndarray
    plan: TilePlan | None = None
    permutation: np.ndarray | None = None


def assemble(kind: str, fmt: MaskFormat, walk: Walk) -> AttentionLaunchData:
    """The launch data of ``walk`` on ``fmt``: sentinels appended, orders computed."""
    words = np.ascontiguousarray(walk.words, dtype=np.uint64).ravel()
    q_perm = np.full(fmt.tile_rows * fmt.tile + 4, -1, dtype=np.int32)
    if walk.permutation is not None:
        q_perm[:fmt.seq_len] = walk.permutation
    total = np.asarray(walk.work, dtype=np.int64).sum(axis=0)
    orders = [np.argsort(-total[:rows], kind="stable").astype(np.int32)
              for rows in range(1, fmt.tile_rows + 1)]
    return AttentionLaunchData(
        kind=kind, tile=fmt.tile, tile_rows=fmt.tile_rows, seq_len=fmt.seq_len,
        permuted=walk.permutation is not None,
        fmt_head_stride=0 if fmt.num_heads == 1 else fmt.tile_rows + 1, spec_hash=fmt.spec_hash,
        row_ptr=np.ascontiguousarray(walk.row_ptr, dtype=np.int32).ravel(),
        col_idx=np.concatenate([np.ravel(walk.keys), [0]]).astype(np.int32),
        part_idx=np.concatenate([np.ravel(walk.parts), [-1]]).astype(np.int32),
        bitmaps=words if words.size else np.zeros(2, dtype=np.uint64),
        gather_keys=np.concatenate([np.ravel(walk.gather_keys), np.full(4, -1)]).astype(np.int32),
        q_perm=q_perm,
        row_orders=np.concatenate(orders) if orders else np.zeros(0, np.int32),
        plan=walk.plan, permutation=walk.permutation)


def launch_data(fmt: MaskFormat, config: AttentionConfig) -> LaunchData:
    """What the attention kernel of ``config`` on ``fmt`` is launched with (module doc):
    the walk of ``config``'s family, assembled. Raises StofcError for a walk the mask
    cannot give (a residue permutation that does not pay)."""
    return attention_family(config.kind).launch_data(fmt, config)
