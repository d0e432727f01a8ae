"""The ws kernel's starting config: four consumer warpgroups and when they take ping-pong
turns (``ws_cost.ws_pingpong``, ``skipped_share``), against the measured H100 rows of
``bench/results/ws-variants-c4-h100-2026-11-27.jsonl`` and
``ws-variants-pingpong-c2-h100-2026-11-27.jsonl``."""

from __future__ import annotations

import pytest

from stofc.kernels.attention.ws_cost import (
    PINGPONG_MAX_SKIPPED,
    skipped_share,
    ws_config,
    ws_pingpong,
)
from stofc.kernels.attention.ws_plan import default_split, plan_ws
from stofc.masks import encode
from stofc.targets import get_profile

H100 = get_profile("h100")
LONGFORMER = "longformer:window=256,global=16"
BIGBIRD = "bigbird:block=64,window=3,global=2,random=3,seed=0"


def _plan(spec: str, length: int, consumers: int, batch: int = 1, heads: int = 12):
    fmt = encode(spec, length)
    split = default_split(fmt, batch=batch, heads=heads, sm_count=132, consumers=consumers)
    return plan_ws(fmt, split_tiles=split, consumers=consumers)


def test_skipped_share_counts_the_pairs_a_warpgroup_skips():
    assert skipped_share(_plan("dense", 8192, 4)) == 0.0
    # a causal pair row of C tile rows: row i skips the C - 1 - i diagonal tiles past it
    assert 0.0 < skipped_share(_plan("causal", 8192, 4)) < 0.05
    # a +-256 band: each of four rows holds 9 of the 12 tiles of their union
    assert skipped_share(_plan("sliding:window=256", 8192, 4)) == pytest.approx(0.25, abs=0.01)
    assert skipped_share(_plan(LONGFORMER, 8192, 4)) > 0.3
    assert skipped_share(_plan(BIGBIRD, 8192, 4)) > 0.5


@pytest.mark.parametrize("spec,turns", [("dense", True), ("causal", True),
                                        ("sliding:window=4095,causal=true", True),
                                        ("sliding:window=256", False), (LONGFORMER, False),
                                        (BIGBIRD, False)])
def test_four_consumers_take_turns_only_on_walks_that_skip_little(spec, turns):
    """Four at head_dim 64: turns ran dense and causal rows 8-25% faster, Longformer,
    BigBird and +-256 windows 3-8% slower (same calls)."""
    plan = _plan(spec, 8192, 4)
    assert ws_pingpong(plan) is turns
    assert (skipped_share(plan) <= PINGPONG_MAX_SKIPPED) is turns


@pytest.mark.parametrize("spec", ["dense", "causal", LONGFORMER])
def test_three_never_two_always(spec):
    """Three: turns never paid (head_dim 64 level to 4% slower, 128 level to 6%); two: -2.4%
    to +2.4% at 64, level on 128's sparse masks: kept."""
    assert not ws_pingpong(_plan(spec, 8192, 3))
    assert ws_pingpong(_plan(spec, 8192, 2))


@pytest.mark.parametrize("case,spec,warps,turns", [
    # (B, H, L) head_dim 64: four with turns on dense and causal rows (8-13% over three),
    # four without on Longformer at B=1 8K once four read Q from two buffers (84.2 us against
    # three's 85.8, ws-variants-d64-consumers-qbufs-h100-2026-11-27) and +-256 windows (58.3
    # us, level with three), four without on BigBird at B=1 8K (78.9 us; two with turns, the pick before
    # the per-warpgroup term, 84.5); since 2026-11-29 one consumer (three blocks an SM, no
    # turns) on Longformer and BigBird at B=1 8K and +-64 windows at B=8 L=512
    # (ws-variants-c1x3-h200-2026-11-29: 62.0 / 60.0 / 18.1 us against the others' best
    # 68.8 / 70.6 / 20.4), four still on +-256 windows (46.9 against one's 49.1)
    ((4, 12, 4096), "dense", 20, True), ((2, 12, 16384), "causal", 20, True),
    ((1, 12, 8192), LONGFORMER, 8, False), ((1, 12, 8192), "sliding:window=256", 20, False),
    ((1, 12, 8192), BIGBIRD, 8, False), ((8, 12, 512), "sliding:window=64", 8, False)])
def test_selector_starting_configs(case, spec, warps, turns):
    b, h, length = case
    cfg = ws_config(encode(spec, length), H100, batch=b, heads=h, head_dim=64)
    assert cfg is not None and (cfg.warps, cfg.pingpong) == (warps, turns)


def test_head_dim_128_never_takes_four():
    """Dense at (1, 16, 8192): three consumers without turns (546.6 TF/s against 542.9 with)."""
    cfg = ws_config(encode("dense", 8192), H100, batch=1, heads=16, head_dim=128)
    assert cfg is not None and (cfg.warps, cfg.pingpong) == (16, False)
