"""Other deal orders of a ws plan's works, for bench/ws_variants.py's A/B (a probe: the
product deals longest first, ``ws_plan.plan_ws``).

The kernel deals a run's works from ``plan.orders`` (per head, per run length); these
return a plan whose orders are permuted within each run's live prefix (the items of pair
rows inside the run), so the same works run, each once, in another order.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from stofc.kernels.attention.ws_plan import WS_TILE, WsPlan


def spread_orders(plan: WsPlan, stride: int) -> WsPlan:
    """``plan`` with each run's order of every head rearranged so that the split rows'
    chunks (items with a combine slot) take every ``stride``-th place of the live prefix,
    the other works the places between, both in their longest-first order (the items past
    the live prefix, no one's in that run, stay where they are)."""
    orders = plan.orders.copy()
    for h in range(plan.num_heads):
        pair_of, slot = plan.items[h, :, 0], plan.items[h, :, 3]
        for p in range(1, plan.pairs + 1):
            a, b = int(plan.order_ptr[p - 1]), int(plan.order_ptr[p])
            seg = orders[h, a:b]
            live = int(((pair_of[seg] >= 0) & (pair_of[seg] < p)).sum())
            head = seg[:live]
            chunks = [int(i) for i in head if slot[i] >= 0]
            rest = [int(i) for i in head if slot[i] < 0]
            out: list[int] = []
            while chunks or rest:
                if chunks and (len(out) % stride == 0 or not rest):
                    out.append(chunks.pop(0))
                else:
                    out.append(rest.pop(0))
            orders[h, a:a + live] = out
    orders.setflags(write=False)
    return replace(plan, orders=orders)


def local_orders(plan: WsPlan, where: str) -> WsPlan:
    """``plan`` with each run's live items of every head in the order of the key tiles they
    walk: an ordinary work at its pair row, a split row's chunk at the pair row whose
    diagonal holds its middle key tile, just ``where`` ("after", "before") that pair row's
    own work (ties: the earlier order first; the items past the live prefix stay)."""
    orders = plan.orders.copy()
    c = plan.consumers
    keys = plan.entry_key
    for h in range(plan.num_heads):
        items = plan.items[h]
        for p in range(1, plan.pairs + 1):
            a, b = int(plan.order_ptr[p - 1]), int(plan.order_ptr[p])
            seg = orders[h, a:b]
            live = int(((items[seg, 0] >= 0) & (items[seg, 0] < p)).sum())
            pos = []
            for i in seg[:live]:
                prow, lo, hi, slot = (int(v) for v in items[i, :4])
                if slot < 0 or hi <= lo:
                    pos.append(float(prow))
                else:
                    mid = int(keys[(lo + hi - 1) // 2]) // (WS_TILE * c)   # keys are rows
                    pos.append(mid + (0.5 if where == "after" else -0.5))
            orders[h, a:a + live] = seg[:live][np.argsort(pos, kind="stable")]
    orders.setflags(write=False)
    return replace(plan, orders=orders)
