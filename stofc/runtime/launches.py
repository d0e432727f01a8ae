"""How :class:`~stofc.runtime.attention.AttentionOp` launches each attention family's kernel.

A launch form owns what is uploaded once for an op (the family's launch data) and how
one checked launch becomes a :class:`~stofc.runtime.module.BoundLaunch`: the kernel's
argument list. :class:`WalkLaunch` serves the walk-list kernels (block-wise, row-wise:
``kernel_abi`` 3, ``cuda/ort/attention_abi.h``); a form with another argument list
registers its own with :func:`launches` (the warp-specialised kernel:
:mod:`stofc.runtime.attention_ws`). A family with two launch forms is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from stofc.errors import RegistryError, StofcError
from stofc.runtime.module import BoundLaunch, LoadedKernel


@dataclass(frozen=True)
class View:
    """A [B, S, heads, D] operand: its array, sizes and element strides (batch, seq, head)."""

    array: Any
    batch: int
    seq: int
    heads: int
    strides: tuple[int, int, int]


@dataclass(frozen=True)
class Operands:
    """One checked launch (:meth:`~stofc.runtime.attention.AttentionOp.bind`): the views,
    the key lengths and key bits, the bias, the scalars and the loaded kernels (main first)."""

    q: View
    k: View
    v: View
    out: View
    kv_len: Any
    key_words: int
    key_bits: Any
    bias: Any
    bias_strides: tuple[int, int, int]
    scale: float
    kv_group: int
    softcap: float
    batch: int
    heads: int
    seq: int
    kernels: tuple[LoadedKernel, ...]


class Launch(Protocol):
    """What a launch form does for one op: ``bind`` one launch."""

    def bind(self, ops: Operands) -> BoundLaunch: ...


_LAUNCHES: dict[str, Callable[[Any], Launch]] = {}
L = TypeVar("L", bound=type)


def launches(*families: str) -> Callable[[L], L]:
    """Class decorator: the launch form of ``families`` (loud on a second one)."""
    def wrap(cls: L) -> L:
        for name in families:
            if name in _LAUNCHES:
                raise RegistryError(f"attention family {name!r} has two launch forms")
            _LAUNCHES[name] = cls
        return cls
    return wrap


def launch_for(op: Any) -> Launch:
    """The launch form of ``op``'s family, set up for ``op`` (its data uploaded)."""
    try:
        form = _LAUNCHES[op.family.name]
    except KeyError:
        raise StofcError(f"the CuPy runtime cannot launch attention family {op.family.name!r}",
                         hint="use another attention kernel") from None
    return form(op)


@launches("attention_block", "attention_row")
class WalkLaunch:
    """The walk-list kernels: the launch data (:mod:`stofc.kernels.attention.launch`) on the
    device, one launch of ``heads * batch * rows * blocks per tile row`` blocks."""

    def __init__(self, op: Any) -> None:
        cp = op._cp
        self.op = op
        self.data = data = op.family.launch_data(op.fmt, op.config)
        self._row_ptr = cp.asarray(data.row_ptr)
        self._col_idx = cp.asarray(data.col_idx)
        self._part_idx = cp.asarray(data.part_idx)
        self._bitmaps = cp.asarray(data.bitmaps)
        self._gather_keys = cp.asarray(data.gather_keys)
        self._q_perm = cp.asarray(data.q_perm)
        self._orders: dict[int, tuple[Any, int]] = {}

    def _order(self, seq_len: int) -> tuple[Any, int]:
        """Tile rows that hold queries < seq_len, longest (most allowed elements) first."""
        if seq_len not in self._orders:
            self._orders[seq_len] = (self.op._cp.asarray(self.data.order(seq_len)),
                                     self.data.rows(seq_len))
        return self._orders[seq_len]

    def bind(self, ops: Operands) -> BoundLaunch:
        op, data = self.op, self.data
        order, rows = self._order(ops.seq)
        grid = ops.heads * ops.batch * rows * op.family.blocks_per_tile_row(op.config)
        i64, i32 = np.int64, np.int32
        args = (ops.q.array, ops.k.array, ops.v.array, ops.out.array,
                *(i64(s) for s in ops.q.strides), *(i64(s) for s in ops.k.strides),
                *(i64(s) for s in ops.v.strides), *(i64(s) for s in ops.out.strides),
                self._row_ptr, self._col_idx, self._part_idx, self._bitmaps, self._gather_keys,
                self._q_perm, i32(data.permuted), i32(data.fmt_head_stride), order, ops.kv_len,
                ops.key_bits, i32(ops.key_words), ops.bias,
                *(i64(s) for s in ops.bias_strides),
                i32(ops.batch), i32(ops.heads), i32(ops.seq), np.float32(ops.scale),
                i32(ops.kv_group), np.float32(ops.softcap))
        return BoundLaunch(ops.kernels[0], grid, op.config.threads, args, result=ops.out.array)
