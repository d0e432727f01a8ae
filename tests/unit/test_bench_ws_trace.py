"""bench/ws_trace.py's split of a traced launch by kind of work, on a hand-built trace."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stofc.kernels.attention.ws_plan import plan_ws
from stofc.masks import encode

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ws_trace(monkeypatch):
    pytest.importorskip("cupy")          # ws_trace imports the runtime (its CuPy kernels)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import ws_trace as mod
    return mod


def _work_of(plan, want_shared: bool, heads: int, seq_len: int) -> int:
    """A work index (head 1, batch 0) whose item is (or is not) a shared chunk."""
    offset, count = plan.launch_items(seq_len)
    for idx in range(count):
        item = plan.items[0][plan.orders[0][offset + idx]]
        if item[0] >= 0 and (item[4] > 0) == want_shared:
            return idx * heads + 1
    raise AssertionError("no such work")


def _plan_and_works():
    """A two-consumer Longformer walk with split global rows, its (heads, L, C), and one
    shared-chunk work and one ordinary work of it."""
    plan = plan_ws(encode("longformer:window=128,global=16", 2048), split_tiles=8, consumers=2)
    heads, L, C = 2, 2048, 2
    return plan, heads, L, C, _work_of(plan, True, heads, L), _work_of(plan, False, heads, L)


def test_by_kind_splits_shared_chunks_from_the_rest(ws_trace):
    plan, heads, L, C, shared_wk, other_wk = _plan_and_works()
    items = ws_trace.work_items(plan, np.array([shared_wk, other_wk]), heads, 1, L)
    assert items[0, 4] > 0 and items[1, 4] == 0
    n_sh, n_ot = (int(it[2] - it[1]) for it in items)
    rec = np.zeros((ws_trace.TRACE_BLOCKS, C + 1, ws_trace.TRACE_WORKS, ws_trace.FIELDS),
                   np.uint64)
    # producer: (work, start, after the Q buffer, end, slot waits, tiles)
    rec[0, 0, 0] = [shared_wk, 100, 300, 300 + 2000 + 500, 500, n_sh, 0, 0]
    rec[1, 0, 0] = [other_wk, 100, 150, 150 + 9000 + 1000, 1000, n_ot, 0, 0]
    # consumers: (work, start, Q, steps end, end, K waits, turns, steps << 32 | computed);
    # block 1's consumers saw an empty work first (no producer record of its own): the
    # records pair by work, not by position
    for w in range(C):
        rec[0, 1 + w, 0] = [shared_wk, 10, 20, 20 + 1100 * n_sh, 30 + 1100 * n_sh,
                            100 * n_sh, 0, 0]
        rec[1, 1 + w, 0] = [other_wk + 2 * heads, 1, 2, 3, 4, 5, 0, 0]
        rec[1, 1 + w, 1] = [other_wk, 10, 20, 20 + 1900 * n_ot + 10 * w, 99999, 90 * n_ot, 0, 0]
    got = ws_trace.by_kind(rec, plan, heads, 1, L)
    assert got["shared"] == {"works": 1, "walked": float(n_sh), "steps_per_entry": 1100.0,
                             "k_wait_per_entry": 100.0,
                             "producer_own_per_tile": round(2000 / n_sh, 0),
                             "producer_slot_wait": 500.0}
    assert got["other"]["works"] == 1 and got["other"]["walked"] == float(n_ot)
    assert got["other"]["steps_per_entry"] == round((1900 * n_ot + 5) / n_ot, 0)
    assert got["other"]["producer_own_per_tile"] == round(9000 / n_ot, 0)
    assert got["other"]["k_wait_per_entry"] == 90.0


def test_step_kinds_splits_a_shared_chunks_steps_by_who_computes_them(ws_trace):
    plan, heads, L, C, shared_wk, other_wk = _plan_and_works()
    n = 6                                            # steps stamped in the shared chunk
    rec = np.zeros((ws_trace.TRACE_BLOCKS, C + 1, ws_trace.TRACE_WORKS, ws_trace.FIELDS),
                   np.uint64)
    stamps = np.zeros((ws_trace.TRACE_BLOCKS, C, ws_trace.TRACE_WORKS, ws_trace.TRACE_STEPS, 2),
                      np.uint32)
    # warpgroup w computes steps t with t % 2 == w: a computed step lasts 1000 cycles and
    # waits 40 for K, the skipped step after it 300 (its P V) waiting 20, others 50 / 10
    for w in range(C):
        t0, prev = 0, False
        for t in range(n):
            mine = t % C == w
            dur, wait = (1000, 40) if mine else (300, 20) if prev else (50, 10)
            stamps[0, w, 0, t] = [t0, t0 + wait]
            t0 += dur
            prev = mine
        # (work, start, Q = tc1, steps end = tc1 + the steps, end, ..., steps << 32)
        rec[0, 1 + w, 0] = [shared_wk, 0, 5, 5 + t0, 9 + t0, 0, 0, n << 32]
        # an ordinary work of two steps, 700 and 800 cycles, waits 70 and 80
        stamps[0, w, 1, :2] = [[0, 70], [700, 780]]
        rec[0, 1 + w, 1] = [other_wk, 0, 100, 100 + 1500, 2000, 0, 0, 2 << 32]
    # a third work of 40 steps, 100 cycles each: only the 31 whose end is stamped count
    S = ws_trace.TRACE_STEPS
    for w in range(C):
        stamps[0, w, 2, :, 0] = np.arange(S) * 100
        stamps[0, w, 2, :, 1] = np.arange(S) * 100 + 75
        rec[0, 1 + w, 2] = [other_wk, 0, 0, 4000, 4100, 0, 0, 40 << 32]
    got = ws_trace.step_kinds(rec, stamps, plan, heads, 1, L)
    # warpgroup 0: computed 0, 2, 4, after-computed 1, 3, 5; warpgroup 1: skipped 0,
    # computed 1, 3, 5, after-computed 2, 4
    assert got["computed"] == {"steps": 6, "cycles": 1000.0, "k_wait": 40.0}
    assert got["after_computed"] == {"steps": 5, "cycles": 300.0, "k_wait": 20.0}
    assert got["skipped"] == {"steps": 1, "cycles": 50.0, "k_wait": 10.0}
    n_other = 4 + 2 * (S - 1)
    assert got["other"] == {"steps": n_other,
                            "cycles": round((4 * 750 + 2 * (S - 1) * 100) / n_other, 0),
                            "k_wait": 75.0}
