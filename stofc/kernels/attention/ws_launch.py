"""The warp-specialised kernel's launch data (``*.plan.bin`` kind 2), computed without a GPU.

:func:`ws_launch_data` (the family's :meth:`~.ws.AttentionWs.launch_data`) gives the
arrays and scalars that :class:`stofc.runtime.attention_ws.WsLaunchData` uploads and
the package writes for the CUDA twin, one computation for both, for a ``kind="ws"``
config (:func:`stofc.kernels.attention.ws_plan.plan_ws` with the config's ``split`` and
consumer warpgroups): the merged pair-row walk (``entry_key`` + sentinel 0,
``entry_part`` one per consumer warpgroup and entry + one sentinel -2 each), the
part-tile bitmaps (at least two words), the work items ``(pair row, begin, end, slot)``, the longest-first item
orders of every run length with their offsets (``order_ptr``) and counts
(``items_upto``), and the combine table ``(pair row, first slot, chunks)``. The C++
CUDA twin uploads the first six arrays and reads the two per-run-length tables on the
host.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from stofc.errors import StofcError
from stofc.kernels.attention.config import AttentionConfig
from stofc.kernels.attention.launch import LaunchData
from stofc.kernels.attention.residue import split_format
from stofc.kernels.attention.ws_plan import (
    ITEM_FIELDS,
    WS_TILE,
    WsPlan,
    consumers_of,
    lean_walk,
    lean_walk_applies,
    plan_ws,
)
from stofc.masks.format import MaskFormat


@dataclass(frozen=True, eq=False)
class WsLaunchPlan(LaunchData):
    """The uploaded arrays and the scalars of one ws kernel's launches (module docstring).

    ``num_heads`` is the mask format's (1 = shared by every head): per format head
    ``f``, items ``[f * n_items, (f + 1) * n_items)`` (ITEM_FIELDS ints each), orders
    ``[f * orders_per_head, ...)`` and combine rows ``[f * n_split, ...)`` (3 ints each).
    """

    # the arrays of a kind-2 plan file, in file order (the first six are uploaded), and
    # the kind scalars, in header order
    ARRAYS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("entry_key", "<i4"), ("entry_part", "<i4"), ("bitmaps", "<u8"), ("items", "<i4"),
        ("orders", "<i4"), ("combine", "<i4"), ("order_ptr", "<i4"), ("items_upto", "<i4"))
    SCALARS: ClassVar[tuple[str, ...]] = ("pairs", "slots", "n_items", "n_split", "split",
                                          "orders_per_head", "consumers", "period")

    kind: str                # always "ws"
    tile: int
    tile_rows: int
    seq_len: int
    num_heads: int
    spec_hash: str
    pairs: int               # ceil(L_max / rows): blocks of 64 * consumers query rows
    slots: int               # workspace slots per (batch, head)
    n_items: int             # items per format head (padded)
    n_split: int             # combine rows per format head (padded, >= 1)
    split: int               # the config's split (tiles per chunk; 0 = none)
    orders_per_head: int     # order_ptr[-1]
    consumers: int           # consumer warpgroups per block (1 to 4)
    period: int              # residue split (1: none): the walk is the split mask's
    entry_key: np.ndarray
    entry_part: np.ndarray
    bitmaps: np.ndarray
    items: np.ndarray
    orders: np.ndarray
    combine: np.ndarray
    order_ptr: np.ndarray
    items_upto: np.ndarray

    def launch_items(self, seq_len: int) -> tuple[int, int]:
        """(offset into each head's orders, items launched per head) of a run of ``seq_len``:
        ``WsPlan.launch_items`` (a residue split's rows: those of residue 0, the longest)."""
        walked = -(-seq_len // self.period)
        p = min(self.pairs, -(-walked // self.rows))
        return int(self.order_ptr[p - 1]), int(self.items_upto[p])

    @property
    def rows(self) -> int:
        """Query rows per block: 64 per consumer warpgroup."""
        return WS_TILE * self.consumers

    @property
    def items_head_stride(self) -> int:
        return self.n_items * ITEM_FIELDS if self.num_heads > 1 else 0

    @property
    def order_head_stride(self) -> int:
        return self.orders_per_head if self.num_heads > 1 else 0

    @property
    def combine_head_stride(self) -> int:
        return self.n_split * 3 if self.num_heads > 1 else 0

    @property
    def splits(self) -> bool:
        """Whether some pair row is split: the run needs the workspace and the combine kernel."""
        return bool((self.combine.reshape(-1, 3)[:, 0] >= 0).any())

    @property
    def heads(self) -> int:
        return self.num_heads

    @classmethod
    def from_plan_file(cls, common: Mapping[str, Any], heads: int,
                       scalars: Mapping[str, int]) -> WsLaunchPlan:
        fields: dict[str, Any] = {**scalars, **common}
        return cls(num_heads=heads, **fields)


def config_plan(fmt: MaskFormat, config: AttentionConfig) -> WsPlan:
    """:func:`plan_ws` of ``fmt`` for ``config``: its split, consumer count and residue split."""
    return plan_ws(split_format(fmt, config.period), split_tiles=config.split,
                   consumers=consumers_of(config.warps), split_rows=config.split_rows)


def with_lean_walk(fmt: MaskFormat, config: AttentionConfig, head_dim: int) -> AttentionConfig:
    """``config`` with ``lean_walk`` where its plan on ``fmt`` has one (:func:`lean_walk`) and
    ``head_dim`` takes it (:func:`lean_walk_applies` for a node without a bias or key bits:
    tests and benches render the flagged kernel with them too, to check it compiles the
    lean path out)."""
    lean = lean_walk_applies(head_dim, has_bias=False, has_key_bits=False)
    return replace(config, lean_walk=lean and lean_walk(config_plan(fmt, config)))


def ws_launch_data(fmt: MaskFormat, config: AttentionConfig) -> WsLaunchPlan:
    """What a ws kernel of ``config`` on ``fmt`` is launched with: :func:`plan_ws` with the
    config's ``split`` (on the residue-split mask when ``config.period`` > 1; ``seq_len``,
    ``tile_rows`` and ``spec_hash`` stay ``fmt``'s), flattened for upload (empty bitmaps
    become two zero words, empty orders one zero), for the CuPy runtime and the CUDA twin
    alike. A ``lean_walk`` config whose plan on ``fmt`` is not lean is a StofcError: its
    kernel would take part tiles for full ones."""
    plan = config_plan(fmt, config)
    if config.lean_walk and not lean_walk(plan):
        raise StofcError("a lean-walk ws kernel was chosen for a mask whose walk has part tiles",
                         hint="choose the config for this mask again (stofc compile, or "
                              "select_kernel) instead of reusing another mask's")

    def flat(a, dtype) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=dtype).ravel()

    words = np.asarray(plan.bitmaps, np.uint64).ravel()
    return WsLaunchPlan(
        kind="ws", tile=fmt.tile, tile_rows=fmt.tile_rows, seq_len=fmt.seq_len,
        num_heads=plan.num_heads, spec_hash=fmt.spec_hash, pairs=plan.pairs, slots=plan.slots,
        n_items=int(plan.items.shape[1]), n_split=int(plan.combine.shape[1]),
        split=int(config.split), orders_per_head=int(plan.orders.shape[1]),
        consumers=plan.consumers, period=int(config.period),
        entry_key=flat(plan.entry_key, np.int32), entry_part=flat(plan.entry_part, np.int32),
        bitmaps=flat(words if words.size else np.zeros(2, np.uint64), np.uint64),
        items=flat(plan.items, np.int32),
        orders=flat(plan.orders if plan.orders.size else np.zeros((1, 1)), np.int32),
        combine=flat(plan.combine, np.int32), order_ptr=flat(plan.order_ptr, np.int32),
        items_upto=flat(plan.items_upto, np.int32))
