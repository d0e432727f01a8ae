"""The ws kernel's tail split (``split_rows``): a few of the longest pair rows cut into
chunks so that a launch of alike works does not leave most SMs idle for its last wave.

At (1, 16, 8192) head_dim 128 with three consumers a dense mask gives 688 works of 128
entries on 132 SMs: 28 blocks take six works where the mean is 5.2. Cutting two rows per
head into four chunks ran the launch 5.5-7% faster on an H100
(bench/results/ws-variants-tail-h100-2026-11-28.jsonl).
"""

from __future__ import annotations

import numpy as np
import pytest

from stofc.kernels.attention import AttentionConfig, prune
from stofc.kernels.attention.ws import AttentionWs
from stofc.kernels.attention.ws_balance import TAIL_MIN_GAIN, combine_us, dealt_loads
from stofc.kernels.attention.ws_cost import _item_ns, _item_overhead_ns, ws_config, ws_split
from stofc.kernels.attention.ws_launch import ws_launch_data
from stofc.kernels.attention.ws_plan import plan_ws, split_pairs
from stofc.masks import encode
from stofc.targets import get_profile

H100 = get_profile("h100")


def test_split_pairs_takes_the_longest_rows_earlier_first():
    lengths = np.array([5, 20, 20, 7, 20, 30])
    assert split_pairs(lengths, 8, 0).tolist() == [False, True, True, False, True, True]
    assert split_pairs(lengths, 8, 2).tolist() == [False, True, False, False, False, True]
    assert split_pairs(lengths, 8, 3).tolist() == [False, True, True, False, False, True]
    assert split_pairs(lengths, 8, 10).tolist() == split_pairs(lengths, 8, 0).tolist()
    assert not split_pairs(lengths, 0, 2).any()


@pytest.mark.parametrize("consumers", [2, 3, 4])
def test_plan_cuts_only_split_rows(consumers):
    fmt = encode("dense", 4096, tile=64)
    plan = plan_ws(fmt, split_tiles=16, consumers=consumers, split_rows=2)
    items = plan.items[0]
    live = items[items[:, 0] >= 0]
    split = live[live[:, 3] >= 0]
    whole = live[live[:, 3] < 0]
    assert sorted(set(split[:, 0].tolist())) == [0, 1]          # the first two equal rows
    assert len(split) == 2 * 4 and len(whole) == plan.pairs - 2  # 64 entries in chunks of 16
    assert (split[:, 2] - split[:, 1]).tolist() == [16] * 8
    assert plan.combine[0][:, 0].tolist() == [0, 1] and plan.slots == 8
    # every entry of every row is walked exactly once
    covered = np.zeros(int(plan.pair_ptr[0, -1]), int)
    for _, a, b, _, _ in live:
        covered[a:b] += 1
    assert (covered == 1).all()
    # the launch order puts the chunks after every whole row
    off, n = plan.launch_items(4096)
    order = plan.orders[0, off:off + n]
    assert (items[order][-8:, 3] >= 0).all() and (items[order][:-8, 3] < 0).all()


def _busiest(plan, B, H, L, D, overhead=0.0):
    """The busiest block's ns under the kernel's deal of the real plan (each launched item
    paying ``overhead`` besides its walk)."""
    costs = []
    for h in range(plan.num_heads):
        items = plan.items[h]
        launched = (items[:, 0] >= 0) & (items[:, 0] * plan.rows < L)
        costs.append(_item_ns(plan, h, L, D, H100.fp16_tflops / H100.sm_count)
                     + overhead * launched)
    return float(dealt_loads(plan, costs, L, heads=H, batch=B, sm_count=H100.sm_count).max())


@pytest.mark.parametrize("spec,L,run", [("dense", 8192, 8192), ("dense", 8192, 5000),
                                        ("dense", 16384, 8192)])
def test_the_estimate_is_the_plans_own(spec, L, run):
    """What tail_split estimates for its pick is what the plan plan_ws builds from it gives
    under the kernel's deal, also where a package for L_max runs shorter: the rows cut are
    chosen by their full length, as plan_ws chooses them, and chunks past the run are empty
    items that still cost a block their overhead."""
    fmt = encode(spec, L, tile=64)
    split, rows = ws_split(fmt, H100, consumers=3, batch=1, heads=16, seq_len=run, head_dim=128)
    assert rows > 0
    unsplit, tailed = (plan_ws(fmt, consumers=3),
                       plan_ws(fmt, split_tiles=split, consumers=3, split_rows=rows))
    over = _item_overhead_ns(unsplit, 128)
    before = _busiest(unsplit, 1, 16, run, 128, over)
    after = _busiest(tailed, 1, 16, run, 128, over)
    items = tailed.items[0]
    chunks = int(((items[:, 3] >= 0) & (items[:, 0] * 192 < run)).sum()) * 16
    assert after * 1e-3 + combine_us(chunks, 192, 128, H100) < before * 1e-3 * (1 - TAIL_MIN_GAIN)


def test_tail_split_fills_the_partial_last_wave():
    """Dense head_dim 128 at (1, 16, 8192), three consumers: the partial last wave."""
    fmt = encode("dense", 8192, tile=64)
    unsplit = plan_ws(fmt, consumers=3)
    split, rows = ws_split(fmt, H100, consumers=3, batch=1, heads=16, seq_len=8192, head_dim=128)
    assert split >= 8 and 0 < rows < unsplit.pairs
    tailed = plan_ws(fmt, split_tiles=split, consumers=3, split_rows=rows)
    before, after = _busiest(unsplit, 1, 16, 8192, 128), _busiest(tailed, 1, 16, 8192, 128)
    assert after < before * (1.0 - TAIL_MIN_GAIN)
    # the selector's config carries it, and the plan file's name tells it apart
    cfg = ws_config(fmt, H100, batch=1, heads=16, head_dim=128)
    assert cfg is not None and (cfg.split, cfg.split_rows) == (split, rows)
    assert prune(cfg, 128, H100) is None
    assert AttentionWs().launch_key(cfg).endswith(f"-split{split}x{rows}")
    data = ws_launch_data(fmt, cfg)
    assert data.splits and data.slots == int(tailed.slots)


@pytest.mark.parametrize("spec,B,H,L,run,D", [
    ("causal", 1, 16, 8192, 8192, 128),   # rows of every length: the deal already balances them
    ("dense", 1, 16, 16384, 16384, 128),  # 1376 works: 4.4% estimated, below TAIL_MIN_GAIN
    ("dense", 2, 12, 16384, 16384, 64),
    ("dense", 1, 12, 128, 128, 64),       # fewer works than SMs: nothing to fill
    ("dense", 1, 16, 8192, 1000, 128),    # a package for 8192 run at 1000 rows: 96 works
    # a package for 32K run at 8K: each row's run is its first 128 of 512 entries, and a cut
    # row's chunks past the run are items that cost a block its overhead and do nothing
    ("dense", 1, 16, 32768, 8192, 128),
])
def test_no_tail_split_where_the_waves_are_balanced(spec, B, H, L, run, D):
    fmt = encode(spec, L, tile=64)
    consumers = 3 if D == 128 else 4
    assert ws_split(fmt, H100, consumers=consumers, batch=B, heads=H, seq_len=run,
                    head_dim=D) == (0, 0)


def test_outliers_keep_the_default_split():
    """A Longformer mask's global rows are split as before (every row above the chunk)."""
    fmt = encode("longformer:window=256,global=16", 8192, tile=64)
    split, rows = ws_split(fmt, H100, consumers=4, batch=1, heads=12, seq_len=8192, head_dim=64)
    assert split > 0 and rows == 0


def test_split_rows_needs_a_split():
    cfg = AttentionConfig("ws", 64, 16, 16, 2, 1, mma="wgmma", split=0, split_rows=2)
    assert "split_rows" in (prune(cfg, 128, H100) or "")
    assert prune(AttentionConfig("ws", 64, 16, 16, 2, 1, mma="wgmma", split=32, split_rows=2),
                 128, H100) is None


def test_the_tuner_space_holds_the_tail_split():
    """The tuner measures the tail split beside the space's fixed splits, per consumer count
    the cost model gives one for; where none pays, the space is unchanged."""
    from stofc.kernels.attention.family import AttentionProblem

    fam = AttentionWs()
    problem = AttentionProblem(encode("dense", 8192, tile=64), 1, 16, 128, 8192, "bfloat16")
    configs, _ = fam.candidates(problem, H100)
    tails = [c for c in configs if c.split_rows]
    assert tails and all(prune(c, 128, H100) is None for c in tails)
    assert {(c.warps, c.split, c.split_rows) for c in tails} >= {(16, 32, 2)}
    causal = AttentionProblem(encode("causal", 8192, tile=64), 1, 16, 128, 8192, "bfloat16")
    assert not [c for c in fam.candidates(causal, H100)[0] if c.split_rows]
