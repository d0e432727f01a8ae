"""The warp-specialised kernel's launch: its walk on the device, tensor maps, workspace.

:class:`WsLaunch` is the family ``attention_ws``'s launch form
(:mod:`stofc.runtime.launches`); its :class:`WsLaunchData` is what an
:class:`~stofc.runtime.attention.AttentionOp` of a ``kind="ws"`` config holds: the
family's launch data (:class:`~stofc.kernels.attention.ws_launch.WsLaunchPlan`, what the
package writes as the kind-2 ``*.plan.bin``) uploaded once, and :meth:`WsLaunchData.bind`,
which builds one launch (plus the combine kernel's when the plan splits rows) for given q, k, v and out views. The argument
lists are the template's signatures (``templates/attention/block_ws.cu.j2``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stofc.kernels.attention.ws import COMBINE_GROUPS
from stofc.kernels.attention.ws_launch import WsLaunchPlan
from stofc.kernels.attention.ws_plan import WS_BLOCKS_PER_SM
from stofc.runtime.launches import Operands, View, launches
from stofc.runtime.module import BoundLaunch, LoadedKernel
from stofc.runtime.tensor_map import TensorMapCache

COMBINE_THREADS = 256
BOX_COLS = 64            # a 128-byte swizzle panel of 16-bit elements
BOX_ROWS = 64            # a warpgroup's rows / a key tile


@dataclass(frozen=True)
class TensorView:
    """A [B, S, heads, D] view: device address and element strides (batch, seq, head)."""

    address: int
    batch: int
    seq: int
    heads: int
    strides: tuple[int, int, int]


class WsLaunchData:
    """The device arrays of one ws launch plan, and the launches made from them."""

    def __init__(self, plan: WsLaunchPlan, cp, dtype: str, head_dim: int,
                 sm_count: int) -> None:
        self.plan, self.dtype, self.head_dim = plan, dtype, head_dim
        self.sm_count = sm_count           # the persistent grid: WS_BLOCKS_PER_SM blocks an SM
        self._keys = cp.asarray(plan.entry_key)
        self._parts = cp.asarray(plan.entry_part)
        self._bitmaps = cp.asarray(plan.bitmaps)
        self._items = cp.asarray(plan.items)
        self._orders = cp.asarray(plan.orders)
        self._combine = cp.asarray(plan.combine)
        self._maps = TensorMapCache()
        self._cp = cp

    def _map(self, view: TensorView):
        """The view's map: boxes of 64 columns by 64 rows, the rows ``period`` apart (a
        residue's rows, :mod:`stofc.kernels.attention.residue`; 1: contiguous)."""
        item, p = 2, self.plan.period
        return self._maps.get(
            view.address, self.dtype, (self.head_dim, view.heads, view.seq, view.batch),
            (view.strides[2] * item, view.strides[1] * item, view.strides[0] * item),
            (BOX_COLS, 1, BOX_ROWS * p, 1), (1, 1, p, 1))

    def bind(self, kernel: LoadedKernel, combine: LoadedKernel, *, q: TensorView, k: TensorView,
             v: TensorView, out, out_strides: tuple[int, int, int], kv_len, key_words, key_bits,
             bias, bias_strides: tuple[int, int, int], scale: float, kv_group: int,
             softcap: float, batch: int, heads: int, seq: int) -> BoundLaunch:
        """The main launch (and the combine launch after it when rows are split).

        The main kernel is persistent: ``min(works, sm_count x WS_BLOCKS_PER_SM)`` blocks
        walk the works (one item of one head and batch each) in the kernel's deal
        (``ws_work_index``: snaking waves over the grid).
        """
        cp = self._cp
        i32, i64, f32 = np.int32, np.int64, np.float32
        offset, count = self.plan.launch_items(seq)
        order = self._orders[offset:]
        period = self.plan.period          # residues, each walked as a batch of its own
        # work w: head w % H, batch and residue (w / H) % (B P), item order
        n_work = heads * batch * period * count
        slots = self.plan.slots
        if self.plan.splits:
            rows = batch * period * heads * slots * self.plan.rows
            part_o = cp.empty(rows * self.head_dim, dtype=cp.float32)
            part_ml = cp.empty(rows * 2, dtype=cp.float32)
        else:
            part_o = part_ml = cp.zeros(2, dtype=cp.float32)
        osb, oss, osh = (i64(x) for x in out_strides)
        tail = (i32(batch), i32(heads), i32(seq))
        then = None
        if self.plan.splits:
            then = BoundLaunch(combine, heads * batch * period * self.plan.n_split * COMBINE_GROUPS,
                               COMBINE_THREADS,
                               (out, osb, oss, osh, self._combine, i32(self.plan.combine_head_stride),
                                part_o, part_ml, i32(slots), *tail))
        args = (self._map(q), self._map(k), self._map(v), out, osb, oss, osh,
                self._keys, self._parts, self._bitmaps, self._items, order,
                i32(self.plan.items_head_stride), i32(self.plan.order_head_stride),
                kv_len, key_bits, i32(key_words),
                bias, *(i64(x) for x in bias_strides),
                part_o, part_ml, i32(slots), *tail, f32(scale), i32(kv_group), f32(softcap),
                i32(n_work))
        # persistent: WS_BLOCKS_PER_SM blocks on each SM (three with one consumer warpgroup)
        grid = min(n_work, self.sm_count * WS_BLOCKS_PER_SM[self.plan.consumers])
        threads = 128 * (self.plan.consumers + 1)     # a producer and the consumer warpgroups
        return BoundLaunch(kernel, grid, threads, args, result=out, then=then)


@launches("attention_ws")
class WsLaunch:
    """The warp-specialised kernel's launch form: its launch data (the family's) on the
    device, tensor maps per operand, and the combine kernel after the main one when rows
    split."""

    def __init__(self, op) -> None:
        self.data = op.family.launch_data(op.fmt, op.config)
        self.ws = WsLaunchData(self.data, op._cp, op.dtype, op.head_dim, op.profile.sm_count)

    def bind(self, ops: Operands) -> BoundLaunch:
        def tv(view: View) -> TensorView:
            return TensorView(int(view.array.data.ptr), view.batch, view.seq, view.heads,
                              view.strides)

        return self.ws.bind(
            ops.kernels[0], ops.kernels[1], q=tv(ops.q), k=tv(ops.k), v=tv(ops.v),
            out=ops.out.array, out_strides=ops.out.strides, kv_len=ops.kv_len,
            key_words=ops.key_words, key_bits=ops.key_bits, bias=ops.bias,
            bias_strides=ops.bias_strides, scale=ops.scale, kv_group=ops.kv_group,
            softcap=ops.softcap, batch=ops.batch, heads=ops.heads, seq=ops.seq)
