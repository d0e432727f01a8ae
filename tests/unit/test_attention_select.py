"""The selector (STOF formula + GPU cost model), search spaces and pruning reasons."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stofc.kernels.attention import (
    AttentionConfig,
    format_from_dense,
    prune,
    search_space,
    select_kernel,
    smem_bytes,
    stof_threshold,
)
from stofc.kernels.attention.select import nonempty_blocks16
from stofc.kernels.attention.ws_cost import _entry_cum_ns, _item_ns, ws_config
from stofc.kernels.attention.ws_plan import consumers_of, plan_ws
from stofc.masks import encode
from stofc.targets import PROFILES, get_profile

H100 = get_profile("h100")


def _causal(n):
    return np.tril(np.ones((n, n), dtype=bool))


def test_stof_threshold_matches_the_formula():
    n_len = 1024
    fmt = format_from_dense(_causal(n_len), 64)
    n = n_len // 16
    expected = (n * (n + 1) / 2) / n**2 - 1.2 / math.log2(n) ** 2
    assert nonempty_blocks16(fmt) == n * (n + 1) / 2
    assert stof_threshold(fmt, n_len) == pytest.approx(expected)


def test_dense_like_mask_picks_block_and_agrees_with_stof():
    fmt = format_from_dense(_causal(2048), 64)
    a100 = get_profile("a100")
    choice = select_kernel(fmt, a100, batch=4, heads=12, seq_len=2048, head_dim=64)
    assert choice.kernel == "block" and choice.config.kind == "block"
    assert choice.stof_threshold > 0
    assert "agrees" in choice.explanation and "block-wise est." in choice.explanation
    assert choice.block_us < choice.row_us
    assert prune(choice.config, 64, a100) is None
    # on Hopper the warp-specialised kernel refines the block-wise pick: three consumer
    # warpgroups ran causal (4, 2048) at 103 us against the block-wise kernel's 108
    # (bench/results/ws-diag-short-h100-2026-11-26.jsonl); four, with ping-pong turns (the
    # walk skips few pairs), ran causal rows 8-13% faster than three at 4K-16K
    # (ws-variants-c4-h100-2026-11-27.jsonl)
    hopper = select_kernel(fmt, H100, batch=4, heads=12, seq_len=2048, head_dim=64)
    assert hopper.kernel == "ws" and hopper.config.warps == 20 and hopper.config.pingpong
    assert "is refined" in hopper.explanation and hopper.ws_us < hopper.block_us


def test_very_sparse_mask_picks_row_and_agrees_with_stof():
    n = 512
    dense = np.zeros((n, n), dtype=bool)
    rows = np.arange(0, n, 16)
    dense[rows, (rows * 7919) % n] = True                    # 32 scattered elements
    fmt = format_from_dense(dense, 64)
    choice = select_kernel(fmt, H100, batch=1, heads=4, seq_len=n, head_dim=64)
    assert stof_threshold(fmt, n) < 0
    assert choice.kernel == "row" and choice.row_us < choice.block_us
    assert "agrees" in choice.explanation and "row-wise est." in choice.explanation


def test_scattered_mask_overrules_stof_towards_row():
    # every 16x16 block holds one element: STOF says block-wise (density of blocks = 1)
    dense = np.zeros((256, 256), dtype=bool)
    dense[::16, ::16] = True
    fmt = format_from_dense(dense, 64)
    choice = select_kernel(fmt, H100, batch=1, heads=4, seq_len=256, head_dim=64)
    assert stof_threshold(fmt, 256) > 0
    assert choice.kernel == "row"
    assert "overruled" in choice.explanation


def test_scattered_blocks_overrule_stof_towards_block_thanks_to_gathering():
    n = 4096
    fmt = encode("bigbird:block=8,window=1,global=0,random=1,seed=2", n)   # 8x8 blocks, scattered
    choice = select_kernel(fmt, H100, batch=4, heads=12, seq_len=n, head_dim=64)
    assert stof_threshold(fmt, n) < 0
    assert choice.kernel == "block" and choice.config.gather
    assert "overruled" in choice.explanation


def test_small_tile_format_forces_row():
    fmt = format_from_dense(_causal(256), 32)
    choice = select_kernel(fmt, H100, batch=1, heads=2, seq_len=256, head_dim=64)
    assert choice.kernel == "row" and "T=32" in choice.explanation


def test_short_grid_splits_query_rows():
    a100 = get_profile("a100")
    fmt = format_from_dense(_causal(512), 64)
    small = select_kernel(fmt, a100, batch=1, heads=2, seq_len=512, head_dim=64)
    big = select_kernel(format_from_dense(_causal(4096), 64), a100, batch=8, heads=16,
                        seq_len=4096, head_dim=64)
    assert small.config.q_split == 2 and big.config.q_split == 1


@pytest.mark.parametrize("spec,L,consumers", [
    ("dense", 16384, 3), ("causal", 16384, 3), ("dense", 8192, 3), ("causal", 8192, 3),
    ("sliding:window=256", 16384, 2), ("sliding:window=256", 8192, 2),
    ("longformer:window=256,global=16", 16384, 2), ("longformer:window=256,global=16", 8192, 2),
    ("bigbird:block=64,window=3,global=2,random=3,seed=0", 16384, 2),
    ("bigbird:block=64,window=3,global=2,random=3,seed=0", 8192, 2),
])
def test_head_dim_128_consumer_count_follows_the_measured_faster(spec, L, consumers):
    """ws-variants-d128-c3-h100-2026-11-26: at head_dim 128 (B=1 H=16 bf16) three consumer
    warpgroups with Q in shared memory ran dense and causal 4-11% faster than two, and
    +-256 windows, Longformer and BigBird 5-12% slower; the two fitted costs order each."""
    cfg = ws_config(encode(spec, L), H100, batch=1, heads=16, head_dim=128)
    assert cfg is not None and consumers_of(cfg.warps) == consumers


def test_a_shared_chunk_costs_its_whole_walk():
    """A shared chunk's warpgroups step through every entry together (each computing one in
    C), so the model charges the chunk its whole walk, as any item, not a C-th of it."""
    h200 = get_profile("h200")
    L = 4096
    for consumers in (2, 3, 4):
        plan = plan_ws(encode("longformer:window=256,global=16", L), split_tiles=16,
                       consumers=consumers)
        sm_tflops = h200.fp16_tflops / h200.sm_count
        cum = _entry_cum_ns(plan, L, 64, sm_tflops)
        items = plan.items[0]
        ns = _item_ns(plan, 0, L, 64, sm_tflops)
        shared = (items[:, 0] >= 0) & (items[:, 4] > 0)
        assert shared.any()                       # the global row's chunks
        walk = cum[items[:, 2]] - cum[items[:, 1]]
        assert np.allclose(ns[shared], walk[shared]) and (walk[shared] > 0).all()


@pytest.mark.parametrize("spec,B,H,L,consumers", [
    # ws-variants-consumers-short-h200-2026-11-28 and ws-variants-shared-walk-picks-h200-2026-11-28
    # (H200, head_dim 64): four consumers 41.2-43.1 us against three's 49.5-50.1
    ("longformer:window=256,global=16", 1, 12, 4096, 4),
    # ws-variants-c1x3-h200-2026-11-29 (one consumer, three blocks an SM, against the other
    # counts in the same call): 31.5-31.6 us against three consumers' 35.8; 62.0-62.3 against
    # four's 68.8; ws-variants-c1x3-global-h200-2026-11-29: 91.8 against three's 105.5
    ("longformer:window=256,global=16", 1, 4, 8192, 1),
    ("longformer:window=256,global=16", 1, 12, 8192, 1),
    ("global:first=16", 2, 12, 16384, 1),
])
def test_head_dim_64_consumer_count_follows_the_measured_faster(spec, B, H, L, consumers):
    """Where shared chunks decide the consumer count at head_dim 64, the pick is the count
    measured fastest on the H200 (each against the other counts in the same call)."""
    cfg = ws_config(encode(spec, L), get_profile("h200"), batch=B, heads=H, head_dim=64)
    assert cfg is not None and consumers_of(cfg.warps) == consumers


@pytest.mark.parametrize("B,H,L,split", [(1, 12, 8192, 16), (1, 4, 8192, 16), (1, 12, 16384, 16),
                                         (2, 12, 16384, 32)])
def test_one_consumer_bigbird_chunks_of_at_least_sixteen(B, H, L, split):
    """One consumer cuts BigBird's global rows into chunks of 16 or more (ws_plan
    .ONE_CONSUMER_MIN_SPLIT): at (1, 12, 8192) 60.0-60.3 us against 62.5-62.7 in chunks of
    8 (H200, three calls); the other rows keep the chunks measured fastest there
    (ws-variants-c1x3-h200-2026-11-29: 16 at (1, 4, 8192) and (1, 12, 16384), 32 at B=2)."""
    cfg = ws_config(encode("bigbird:block=64,window=3,global=2,random=3,seed=0", L),
                    get_profile("h200"), batch=B, heads=H, head_dim=64)
    assert cfg is not None and consumers_of(cfg.warps) == 1 and cfg.split == split


@pytest.mark.parametrize("spec,L,B,H,D,kind", [
    ("dense", 8192, 1, 16, 128, "ws"),            # measured 1.9x the wgmma block kernel (H100)
    ("causal", 8192, 1, 16, 128, "ws"),
    ("longformer:window=256,global=16", 16384, 1, 12, 64, "ws"),
    ("strided:stride=128", 4096, 4, 12, 64, "block"),   # gathered tiles: block-wise
    # dilated bands: the ws kernel walks the residues apart (period 2), 171.6 TFLOP/s at
    # head_dim 64 where the permuted block-wise kernel ran 115.7 (mha-hopper-h200-2026-11-27-
    # residue and -flex, H200); at head_dim 128 261-263 against 84 (H100, -11-26-prefetch)
    ("dilated:window=256,dilation=2", 4096, 4, 12, 64, "ws"),
    # the strided mask's gathered tiles stay block-wise (115 against ws's 20)
    ("dilated:window=256,dilation=2", 8192, 1, 16, 128, "ws"),
    ("dilated:window=256,dilation=2", 16384, 1, 16, 128, "ws"),
    ("strided:stride=128", 8192, 1, 16, 128, "block"),
])
def test_hopper_picks_the_warp_specialised_kernel_where_it_is_faster(spec, L, B, H, D, kind):
    """The measured picks of bench/results/mha-hopper-h100-2026-11-25-fa4, -11-26-prefetch and
    mha-hopper-h200-2026-11-27-residue (the selector's estimate for ws; block-wise keeps the
    masks whose tiles it gathers; dilated bands go to ws with the residue split)."""
    choice = select_kernel(encode(spec, L), H100, batch=B, heads=H, seq_len=L, head_dim=D)
    assert choice.kernel == kind, choice.explanation
    assert math.isfinite(choice.ws_us) and f"{choice.ws_us:.1f} us" in choice.explanation
    if kind == "ws":
        assert choice.config.kind == "ws" and "warp-specialised" in choice.explanation
        assert choice.config.period == (2 if spec.startswith("dilated") else 1)
    # other GPUs never get it
    a100 = select_kernel(encode(spec, min(L, 4096)), get_profile("a100"), batch=B, heads=H,
                         seq_len=min(L, 4096), head_dim=D)
    assert a100.kernel != "ws" and math.isinf(a100.ws_us)


@pytest.mark.parametrize("name", sorted(PROFILES))
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128])
def test_search_spaces_respect_every_profile(name, head_dim):
    profile = PROFILES[name]
    for kind in ("block", "row"):
        for tile in (64, 128):
            space = search_space(kind, head_dim, "float16", profile, tile=tile)
            assert len(set(space)) == len(space)
            for cfg in space:
                assert prune(cfg, head_dim, profile) is None
                assert smem_bytes(cfg, head_dim) <= profile.smem_per_block
    assert search_space("block", head_dim, "float16", profile, tile=64)
    assert search_space("row", head_dim, "float16", profile, tile=64)


def test_prune_reasons_say_why():
    assert "shared memory" in prune(AttentionConfig("block", 128, 16, 8, 4, 1), 128, get_profile("a10"))
    assert "registers" in prune(AttentionConfig("block", 128, 32, 4, 2, 1), 128, H100)
    assert "warps must equal" in prune(AttentionConfig("block", 64, 16, 2, 2, 1), 64, H100)
    assert "stages" in prune(AttentionConfig("block", 64, 16, 4, 1, 1), 64, H100)
    assert "T >= 64" in prune(AttentionConfig("block", 32, 16, 2, 2, 1), 64, H100)
    assert "inside one tile row" in prune(AttentionConfig("row", 16, 4, 8), 64, H100)
    assert prune(AttentionConfig("row", 64, 4, 8), 64, H100) is None
    assert "gathered" in prune(AttentionConfig("row", 64, 1, 4, gather=True), 64, H100)
