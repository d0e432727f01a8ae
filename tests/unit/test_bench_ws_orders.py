"""bench/ws_orders.py: the deal orders ws_variants.py times against the product's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from stofc.kernels.attention.ws_plan import WS_TILE, plan_ws
from stofc.masks import encode

# loaded from its file: bench/ on sys.path would shadow module names for other tests
_SPEC = importlib.util.spec_from_file_location(
    "bench_ws_orders", Path(__file__).resolve().parents[2] / "bench" / "ws_orders.py")
assert _SPEC is not None and _SPEC.loader is not None
_MOD = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_MOD)
local_orders, spread_orders = _MOD.local_orders, _MOD.spread_orders

L, C = 4096, 4


@pytest.fixture(scope="module")
def plan():
    # the global rows walk every key tile: their pair row (only) is cut into chunks of 16
    p = plan_ws(encode("longformer:window=256,global=16", L), split_tiles=16, consumers=C)
    split = p.items[0, :, 3] >= 0
    assert 1 < split.sum() < split.size and set(p.items[0, split, 0]) == {0}
    return p


def _runs(plan):
    """(head, run length p, its order segment, the live prefix's length) of every run."""
    for h in range(plan.num_heads):
        for p in range(1, plan.pairs + 1):
            a, b = int(plan.order_ptr[p - 1]), int(plan.order_ptr[p])
            seg = plan.orders[h, a:b]
            pair_of = plan.items[h, seg, 0]
            yield h, p, seg, int(((pair_of >= 0) & (pair_of < p)).sum())


def _same_works(before, after):
    """Every run deals the same works, its live prefix only permuted, the rest in place."""
    for (_, _, old, live), (_, _, new, live2) in zip(_runs(before), _runs(after), strict=True):
        assert live == live2
        assert sorted(old[:live]) == sorted(new[:live])
        assert list(old[live:]) == list(new[live:])


@pytest.mark.parametrize("stride", [1, 3, 5])
def test_spread_puts_chunks_at_every_nth_place(plan, stride):
    out = spread_orders(plan, stride)
    _same_works(plan, out)
    h, _p, seg, live = list(_runs(out))[-1]                  # the full-length run
    slot = out.items[h, seg[:live], 3]
    chunks = np.nonzero(slot >= 0)[0]
    assert chunks.size > 1
    rest = live - chunks.size
    # a chunk at every stride-th place while ordinary works remain to fill the gaps
    expect = [i * stride for i in range(chunks.size) if i * stride <= rest + i]
    assert list(chunks[:len(expect)]) == expect
    # which the product's plan does not: it deals the shared chunks last (shortest by
    # per-warpgroup entries)
    before = plan.items[h, list(_runs(plan))[-1][2][:live], 3]
    assert list(np.nonzero(before >= 0)[0]) != list(chunks)


@pytest.mark.parametrize("where", ["after", "before"])
def test_local_order_puts_each_chunk_beside_its_key_tiles_pair_row(plan, where):
    out = local_orders(plan, where)
    _same_works(plan, out)
    h, _p, seg, live = list(_runs(out))[-1]
    items = out.items[h, seg[:live]]
    checked = 0
    for i, (_prow, lo, hi, slot, _) in enumerate(items):
        if slot < 0:
            continue
        mid = int(out.entry_key[(lo + hi - 1) // 2]) // (WS_TILE * C)
        ordinary = [j for j, it in enumerate(items) if it[3] < 0 and it[0] == mid]
        if not ordinary:                 # pair row 0: its band is the chunk's own first part
            continue
        assert (i > ordinary[0]) if where == "after" else (i < ordinary[0])
        assert abs(i - ordinary[0]) == 1                   # right beside it
        checked += 1
    assert checked >= 2
    # ordinary works in pair-row order
    rows = [int(it[0]) for it in items if it[3] < 0]
    assert rows == sorted(rows)
