"""GPU correctness of the warp-specialised Hopper kernel (kind "ws") against float64.

Skipped on GPUs other than sm_90. Every MASKS.md family, head_dims 64/128/256 and both
dtypes, blocks of one to four consumer warpgroups (three: head_dim 64, and 128 with Q
read from shared memory; four and one: head_dim 64, one with three blocks an SM), split rows merged
by the combine kernel, ping-pong on and off, every ring depth,
grouped-query attention, soft-capping, padding by lengths and 0/1 masks, bias, both
layouts, packed QKV, per-head masks, rows without keys, a run shorter than L_max, and
dilated masks walked by residue (period 2 and 4: odd lengths, padding bits, bias, GQA), and
lean walks (every entry a full tile: dense rows, tile-aligned block masks).
Outputs are NaN-poisoned before each launch; inputs are fresh per case.
"""

from __future__ import annotations

import numpy as np
import pytest

from stofc.kernels.attention import AttentionConfig, prune, search_space
from stofc.kernels.attention.reference import format_from_dense, from_bf16_bits, reference_attention
from stofc.kernels.attention.ws_plan import WS_BLOCKS_PER_SM
from stofc.targets import detect
from tests.gpu.test_attention import FAMILIES, _seed, check_padding_bias_layouts
from tests.gpu.test_attention_helpers import TOL, encoded, quantise, run_case


def _hopper() -> bool:
    try:
        return detect().compute_capability == (9, 0)
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _hopper(), reason="the ws kernel needs an sm_90 GPU")


def ws(stages: int = 2, split: int = 0, pingpong: bool = True, kstep: int = 1,
       consumers: int = 2, period: int = 1) -> AttentionConfig:
    """A ws config; one consumer warpgroup runs three blocks an SM and takes no turns."""
    return AttentionConfig("ws", 64, 16, 4 * (consumers + 1), max(stages, 2 * kstep), 1,
                           min_blocks=WS_BLOCKS_PER_SM[consumers], mma="wgmma", split=split,
                           pingpong=pingpong and consumers > 1, kstep=kstep, period=period)


# (kstep, consumers) of the head_dim 64 cases: one, three and four consumers run one tile per step
STEPS = [(1, 1), (1, 2), (2, 2), (1, 3), (1, 4)]


def _check(res, dtype, what=""):
    assert not res.nan, f"NaN in the output {what}"
    assert res.err <= TOL[dtype], f"relative error {res.err:.2e} > {TOL[dtype]} {what}"


@pytest.mark.parametrize("kstep,consumers", STEPS)
@pytest.mark.parametrize("split", [0, 8])
@pytest.mark.parametrize("spec", FAMILIES)
def test_every_family(spec, split, kstep, consumers):
    fmt, dense = encoded(spec, 1000)
    res = run_case(fmt, dense, ws(split=split, kstep=kstep, consumers=consumers), batch=2,
                   heads=3, seq=1000, head_dim=64,
                   seed=_seed("ws", spec, split, kstep, consumers))
    _check(res, "float16", spec)


@pytest.mark.parametrize("split", [0, 8])
@pytest.mark.parametrize("spec", FAMILIES)
def test_every_family_head_dim_128_three_consumers(spec, split):
    """head_dim 128 with three consumer warpgroups: S = Q K^T reads Q from shared memory."""
    fmt, dense = encoded(spec, 1000)
    res = run_case(fmt, dense, ws(split=split, consumers=3), batch=2, heads=2, seq=1000,
                   head_dim=128, dtype="bfloat16", seed=_seed("ws128c3", spec, split))
    _check(res, "bfloat16", spec)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim,kstep,consumers",
                         [(64, 1, 1), (64, 1, 2), (64, 2, 2), (64, 1, 3), (64, 1, 4), (128, 1, 2),
                          (128, 2, 2), (128, 1, 3), (256, 1, 2)])
@pytest.mark.parametrize("pingpong", [True, False])
def test_head_dims_dtypes_pingpong(head_dim, kstep, consumers, dtype, pingpong):
    fmt, dense = encoded("longformer:window=100,global=20", 700)
    res = run_case(fmt, dense, ws(split=8, pingpong=pingpong, kstep=kstep, consumers=consumers),
                   batch=2, heads=2, seq=700, head_dim=head_dim, dtype=dtype,
                   seed=_seed("wsd", head_dim, dtype, pingpong, kstep, consumers))
    _check(res, dtype, f"D={head_dim} kstep={kstep} consumers={consumers} pingpong={pingpong}")


@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_ring_depths_on_long_rows(stages, consumers):
    fmt, dense = encoded("causal", 2048)
    res = run_case(fmt, dense, ws(stages=stages, consumers=consumers), batch=1, heads=2,
                   seq=2048, head_dim=128, dtype="bfloat16",
                   seed=_seed("wsstages", stages, consumers))
    _check(res, "bfloat16", f"stages={stages} consumers={consumers}")


@pytest.mark.parametrize("spec", ["longformer:window=100,global=20", "causal",
                                  "bigbird:block=64,window=3,global=1,random=2,seed=1"])
@pytest.mark.parametrize("head_dim,consumers,stages,pingpong,dtype",
                         [(64, 1, 3, False, "float16"), (64, 1, 2, False, "bfloat16"),
                          (64, 2, 4, True, "float16"), (64, 3, 4, False, "bfloat16"),
                          (64, 4, 4, True, "float16"), (64, 4, 2, False, "bfloat16"),
                          (128, 3, 2, False, "bfloat16")])
def test_many_works_per_block(spec, head_dim, consumers, stages, pingpong, dtype):
    """A grid of three blocks (nine with one consumer: three an SM), so each walks 11-24
    works on average: the K/V ring continues across works and, where Q is read from shared memory (four consumers; three at head_dim 128),
    the two Q buffers (ws_q_buffers) each serve several works, so both buffers' mbarrier
    phases wrap, with split rows and shared chunks among the works."""
    from dataclasses import replace

    from stofc.kernels.attention.ws_smem import ws_q_buffers

    profile = replace(detect(), sm_count=3)
    fmt, dense = encoded(spec, 1000)
    cfg = ws(stages=stages, split=8, pingpong=pingpong, consumers=consumers)
    res = run_case(fmt, dense, cfg, batch=2, heads=3, seq=1000, head_dim=head_dim,
                   dtype=dtype, profile=profile,
                   seed=_seed("wsworks", spec, head_dim, consumers, stages, pingpong))
    assert ws_q_buffers(stages, head_dim, consumers) == (1 if consumers < 3 or
                                                         (consumers == 3 and head_dim == 64) else 2)
    _check(res, dtype, f"{spec} D={head_dim} consumers={consumers} stages={stages}")


@pytest.mark.parametrize("kstep,consumers", STEPS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_padding_bias_layouts(dtype, kstep, consumers):
    check_padding_bias_layouts(ws(split=8, kstep=kstep, consumers=consumers), "ws", dtype,
                               _seed("wspad", dtype, kstep, consumers))


@pytest.mark.parametrize("kv_heads,head_dim,consumers",
                         [(1, 128, 2), (2, 128, 2), (2, 64, 3), (1, 128, 3), (2, 128, 3),
                          (2, 64, 4), (2, 64, 1), (1, 64, 1)])
def test_grouped_query_attention(kv_heads, head_dim, consumers):
    fmt, dense = encoded("sliding:window=150,causal=true", 600)
    res = run_case(fmt, dense, ws(consumers=consumers), batch=2, heads=6, seq=600,
                   head_dim=head_dim, dtype="bfloat16", kv_heads=kv_heads, packed=kv_heads == 2,
                   seq_lens=[600, 431], seed=_seed("wsgqa", kv_heads, head_dim, consumers))
    _check(res, "bfloat16")


@pytest.mark.parametrize("head_dim,consumers", [(128, 2), (256, 2), (64, 3), (128, 3), (64, 4),
                                                (64, 1)])
def test_logit_softcap(head_dim, consumers):
    fmt, dense = encoded("longformer:window=64,global=8", 300)
    key_mask = np.ones((2, 300), np.int32)
    key_mask[1, 225:] = 0
    res = run_case(fmt, dense, ws(consumers=consumers), batch=2, heads=2, seq=300,
                   head_dim=head_dim,
                   dtype="bfloat16", softcap=20.0, score_scale=8.0, key_mask=key_mask,
                   bias_shape=(1, 2, 300, 300), seed=_seed("wscap", head_dim, consumers))
    _check(res, "bfloat16")


@pytest.mark.parametrize("consumers", [1, 2, 3, 4])
def test_per_head_masks_and_split(consumers):
    heads = 3
    rng = np.random.default_rng(_seed("wsheads"))
    per_head = np.stack([np.tril(np.ones((900, 900), bool))] +
                        [rng.random((900, 900)) < p for p in (0.05, 0.3)])
    fmt = format_from_dense(per_head, 64)
    res = run_case(fmt, per_head, ws(split=8, consumers=consumers), batch=2, heads=heads,
                   seq=900, head_dim=64, seed=_seed("wsheads2", consumers))
    _check(res, "float16")


@pytest.mark.parametrize("consumers", [1, 2, 3, 4])
def test_empty_rows_give_zeros(consumers):
    dense = np.zeros((300, 300), dtype=bool)
    dense[100:200, :50] = True                   # rows outside 100..199 have no key
    dense[250:, 250:] = np.tril(np.ones((50, 50), dtype=bool))
    fmt = format_from_dense(dense, 64)
    res = run_case(fmt, dense, ws(consumers=consumers), batch=2, heads=2, seq=300, head_dim=64,
                   seed=_seed("wsempty", consumers))
    _check(res, "float16")
    assert np.all(res.out[:, :100] == 0.0) and np.all(res.out[:, 200:250] == 0.0)


@pytest.mark.parametrize("kstep,consumers", STEPS)
def test_run_shorter_than_the_compiled_length(kstep, consumers):
    """L_max 2048, run at 333: items past the run exit, split chunks past the keys are empty."""
    fmt, dense = encoded("longformer:window=128,global=16", 2048)
    res = run_case(fmt, dense, ws(split=8, kstep=kstep, consumers=consumers), batch=3, heads=2,
                   seq=333, head_dim=64, seed=_seed("wsshort", kstep, consumers))
    _check(res, "float16")


def test_every_config_of_the_search_space():
    fmt, dense = encoded("bigbird:block=32,window=3,global=1,random=2,seed=1", 600)
    space = search_space("ws", 64, "float16", detect(), tile=64)
    assert space and all(prune(c, 64, detect()) is None for c in space)
    for cfg in space:
        res = run_case(fmt, dense, cfg, batch=2, heads=2, seq=600, head_dim=64,
                       seed=_seed("wsspace", cfg))
        _check(res, "float16", cfg.describe())


@pytest.mark.parametrize("head_dim,consumers,stages,staged", [
    (64, 1, 3, True), (64, 2, 4, True), (64, 3, 4, True), (128, 2, 3, True), (128, 3, 2, True),
    (128, 3, 4, False), (256, 2, 2, False)])            # no room beside these rings
def test_output_rows_staged_or_direct(head_dim, consumers, stages, staged):
    """O leaves through the smem staging area (ws_stage_o) or, for an output view whose rows
    are not 16-byte aligned, as 4-byte stores: both match float64, bit for bit each other,
    and leave the view's neighbouring columns and the rows past the run untouched."""
    import cupy as cp

    from stofc.kernels.attention.ws_smem import ws_stage_o
    from stofc.runtime.attention import AttentionOp

    dtype, B, H, L, run = "bfloat16", 2, 3, 700, 650      # 650: the last pair row is partial
    fmt, dense = encoded("longformer:window=96,global=8", L)
    cfg = ws(stages=stages, consumers=consumers)
    assert ws_stage_o(stages, head_dim, consumers) == staged
    rng = np.random.default_rng(_seed("wsstage", head_dim, consumers, stages))
    (qh, q), (kh, k), (vh, v) = (quantise(rng.standard_normal((B, run, H, head_dim)), dtype)
                                 for _ in range(3))
    op = AttentionOp(fmt, cfg, dtype, head_dim, detect())
    poison = np.uint16(0x7FC0)
    whole = cp.full((B, run, H, head_dim), poison, dtype=np.uint16)
    wide = cp.full((B, run, H, head_dim + 4), poison, dtype=np.uint16)   # rows 8 bytes off 16
    view = wide[..., :head_dim]
    for out in (whole, view):
        op.run(cp.asarray(qh), cp.asarray(kh), cp.asarray(vh), out)
    cp.cuda.runtime.deviceSynchronize()
    got, got_view = cp.asnumpy(whole), cp.asnumpy(view)
    assert np.array_equal(got, got_view), "the staged and direct stores differ"
    assert np.all(cp.asnumpy(wide[..., head_dim:]) == poison), "a store left its row"
    ref = reference_attention(q, k, v, dense, 1.0 / np.sqrt(head_dim))   # (cut to the run)
    out64 = from_bf16_bits(got).astype(np.float64)
    assert not np.isnan(out64).any()
    err = float(np.linalg.norm(out64 - ref) / np.linalg.norm(ref))
    assert err <= TOL[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("head_dim,consumers", [(64, 1), (64, 2), (64, 3), (64, 4), (128, 2),
                                                (128, 3)])
def test_non_finite_values_stay_in_their_rows(head_dim, consumers):
    """NaN in the values of keys 0..63 reaches only the rows whose walk holds key tile 0
    (the rows whose window holds those keys); with several works per block, every other
    row, some computed right after a poisoned work by the same warpgroup, is finite and
    correct (each work starts from a cleared accumulator)."""
    import cupy as cp

    from stofc.runtime.attention import AttentionOp

    dtype, B, H, L, win = "float16", 2, 16, 2048, 64
    fmt, dense = encoded(f"sliding:window={win}", L)
    rng = np.random.default_rng(_seed("wsnan", head_dim, consumers))
    (qh, q), (kh, k), (vh, v) = (quantise(rng.standard_normal((B, L, H, head_dim)), dtype)
                                 for _ in range(3))
    vh = vh.copy()
    vh[:, :64] = np.float16(np.nan)
    out = cp.full((B, L, H, head_dim), np.float16(np.nan), dtype=np.float16)
    op = AttentionOp(fmt, ws(consumers=consumers), dtype, head_dim, detect())
    op.run(cp.asarray(qh), cp.asarray(kh), cp.asarray(vh), out)
    got = cp.asnumpy(out).astype(np.float64)
    reached = dense[0][:, :64].any(axis=1)              # rows whose window holds a NaN key
    assert np.isnan(got[:, reached]).all()
    clean = v.copy()
    clean[:, :64] = 0.0
    ref = reference_attention(q, k, clean, dense, 1.0 / np.sqrt(head_dim))
    rest = ~reached
    assert np.isfinite(got[:, rest]).all(), "NaN leaked into rows that never see the NaN keys"
    err = float(np.linalg.norm(got[:, rest] - ref[:, rest]) / np.linalg.norm(ref[:, rest]))
    assert err <= TOL[dtype], f"relative error {err:.2e}"


# ---------------------------------------------------------------- the residue split
RESIDUE_MASKS = [("dilated:window=256,dilation=2", 1001, 2),
                 ("dilated:window=100,dilation=4", 1500, 4),
                 ("dilated:window=256,dilation=2,causal=true", 2000, 2)]


@pytest.mark.parametrize("consumers", [1, 2, 3, 4])
@pytest.mark.parametrize("split", [0, 8])
@pytest.mark.parametrize("spec,L,period", RESIDUE_MASKS)
def test_residue_split(spec, L, period, split, consumers):
    """Each residue's rows walk the split mask through maps that step ``period`` rows; the
    lengths are not multiples of the period (the last residues one row short), and a run
    shorter than L_max (odd) is checked too."""
    from stofc.kernels.attention.residue import choose_period
    fmt, dense = encoded(spec, L)
    assert choose_period(fmt)[0] == period
    cfg = ws(stages=3 if consumers == 1 else 4, split=split, consumers=consumers, period=period)
    for seq in (L, 777):
        res = run_case(fmt, dense, cfg, batch=2, heads=3, seq=seq, head_dim=64,
                       seq_lens=[seq, seq - 130],
                       seed=_seed("wsres", spec, split, consumers, seq))
        _check(res, "float16", f"{spec} seq={seq}")


@pytest.mark.parametrize("head_dim,consumers,dtype", [(128, 2, "bfloat16"), (128, 3, "bfloat16"),
                                                      (256, 2, "float16")])
def test_residue_split_head_dims(head_dim, consumers, dtype):
    fmt, dense = encoded("dilated:window=256,dilation=2", 1200)
    res = run_case(fmt, dense, ws(split=8, consumers=consumers, period=2), batch=2, heads=2,
                   seq=1199, head_dim=head_dim, dtype=dtype,
                   seed=_seed("wsresd", head_dim, consumers, dtype))
    _check(res, dtype, f"D={head_dim}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("consumers,period", [(2, 2), (3, 2), (1, 2)])
def test_residue_split_padding_bias_layouts(dtype, consumers, period):
    """0/1 key masks (the padding bits of every period-th key), lengths, bias (columns
    period apart), the bhsd layout, packed QKV, a custom scale."""
    check_padding_bias_layouts(ws(split=8, consumers=consumers, period=period), "permute",
                               dtype, _seed("wsrespad", dtype, consumers, period))


def test_residue_split_period_four_key_mask_bias_softcap_gqa():
    fmt, dense = encoded("dilated:window=200,dilation=4", 1300)
    rng = np.random.default_rng(_seed("wsres4"))
    key_mask = (rng.random((2, 1299)) < 0.7).astype(np.int32)
    res = run_case(fmt, dense, ws(split=8, period=4), batch=2, heads=4, seq=1299, head_dim=64,
                   dtype="bfloat16", key_mask=key_mask, bias_shape=(2, 1, 1299, 1299),
                   kv_heads=2, softcap=20.0, seed=_seed("wsres4b"))
    _check(res, "bfloat16")


# ---------------------------------------------------------------- shared chunks
@pytest.mark.parametrize("head_dim,consumers,dtype", [(64, 1, "float16"), (64, 1, "bfloat16"),
                                                      (64, 2, "float16"), (64, 3, "float16"),
                                                      (128, 2, "bfloat16"), (128, 3, "bfloat16")])
def test_shared_chunks_of_global_rows(head_dim, consumers, dtype):
    """A global tile row's chunks past its band run on every warpgroup (each on every C-th
    entry, its own slot; with one consumer they are its ordinary works, each its own slot);
    checked with padding bits, lengths, bias, GQA and a run shorter than L_max whose last
    chunks are empty."""
    from stofc.kernels.attention.ws_plan import consumers_of, plan_ws
    fmt, dense = encoded("longformer:window=128,global=16", 2048)
    cfg = ws(split=8, consumers=consumers)
    plan = plan_ws(fmt, split_tiles=8, consumers=consumers_of(cfg.warps))
    shared, slotted = plan.items[0][:, 4] > 0, plan.items[0][:, 3] >= 0
    if consumers > 1:
        assert shared.sum() >= 2
    else:
        assert not shared.any() and slotted.sum() >= 2
    rng = np.random.default_rng(_seed("wsshared", head_dim, consumers))
    key_mask = (rng.random((2, 2048)) < 0.85).astype(np.int32)
    for seq, kw in ((2048, dict(key_mask=key_mask, bias_shape=(2, 1, 2048, 2048))),
                    (1500, dict(seq_lens=[1500, 777], kv_heads=2)),
                    (300, {})):
        if "key_mask" in kw:
            kw["key_mask"] = key_mask[:, :seq]
        res = run_case(fmt, dense, cfg, batch=2, heads=4, seq=seq, head_dim=head_dim,
                       dtype=dtype, seed=_seed("wsshared2", head_dim, consumers, seq), **kw)
        _check(res, dtype, f"seq={seq} {sorted(kw)}")


def test_rows_cut_into_max_chunks_of_more_than_split_entries(monkeypatch):
    """A row longer than MAX_CHUNKS * split is cut into MAX_CHUNKS longer chunks (ws_plan
    ._chunks; the combine merges no more). MAX_CHUNKS is lowered to 3 so that a 2048-key
    global row (32 entries, split 8: four chunks) has chunks of 10-11 entries."""
    from stofc.kernels.attention import ws_plan
    monkeypatch.setattr(ws_plan, "MAX_CHUNKS", 3)
    fmt, dense = encoded("global:first=16", 2048)
    plan = ws_plan.plan_ws(fmt, split_tiles=8, consumers=2)
    row0 = plan.items[0][plan.items[0][:, 0] == 0]
    assert len(row0) == 3 and (row0[:, 2] - row0[:, 1]).min() > 8
    for seq in (2048, 1100):
        res = run_case(fmt, dense, ws(split=8), batch=2, heads=3, seq=seq, head_dim=64,
                       seq_lens=[seq, seq - 333], seed=_seed("wsmaxchunks", seq))
        _check(res, "float16", f"seq={seq}")


# ---------------------------------------------------------------- tail split (split_rows)
@pytest.mark.parametrize("spec", ["dense", "causal", "sliding:window=600,causal=true"])
@pytest.mark.parametrize("head_dim,consumers,dtype", [(64, 4, "float16"), (64, 1, "bfloat16"),
                                                      (128, 2, "bfloat16"), (128, 3, "bfloat16")])
def test_tail_split_rows(spec, head_dim, consumers, dtype):
    """``split_rows``: only the longest rows (the earlier first among equals) go through the
    combine, the others write O directly, in one launch; checked at L_max, with lengths,
    padding bits and bias, and on a run shorter than L_max that launches some split rows."""
    from dataclasses import replace

    from stofc.kernels.attention.ws_plan import consumers_of, plan_ws
    fmt, dense = encoded(spec, 1500)
    cfg = replace(ws(split=8, consumers=consumers), split_rows=2)
    plan = plan_ws(fmt, split_tiles=8, consumers=consumers_of(cfg.warps), split_rows=2)
    split_rows = plan.combine[0][:, 0]
    assert (split_rows >= 0).sum() == 2 and plan.pairs > 2       # two split, the rest whole
    assert ((plan.items[0][:, 3] < 0) & (plan.items[0][:, 0] >= 0)).any()
    rng = np.random.default_rng(_seed("wstail", spec, head_dim, consumers))
    key_mask = (rng.random((2, 1500)) < 0.85).astype(np.int32)
    for seq, kw in ((1500, dict(key_mask=key_mask, bias_shape=(2, 1, 1500, 1500))),
                    (1500, dict(seq_lens=[1500, 901], kv_heads=1)),
                    (700, {})):
        res = run_case(fmt, dense, cfg, batch=2, heads=2, seq=seq, head_dim=head_dim,
                       dtype=dtype, seed=_seed("wstail2", spec, head_dim, consumers, seq), **kw)
        _check(res, dtype, f"{spec} seq={seq} {sorted(kw)}")


def _mixed_tile_mask(L: int, seed: int) -> np.ndarray:
    """A mask whose tile rows mix empty, full and part tiles at random over more than 32
    steps, so a walk's lean steps (full tiles after a step that computed) start, stop and
    cross the 32-step batches of walk entries."""
    rng = np.random.default_rng(seed)
    t = L // 64
    kind = rng.choice(3, size=(t, t), p=[0.15, 0.6, 0.25])       # empty, full, part
    tiles = np.ones((64, 64), bool)
    full = np.kron(kind == 1, tiles)
    part = np.kron(kind == 2, tiles) & (rng.random((L, L)) < 0.5)
    return full | part


@pytest.mark.parametrize("head_dim,consumers,dtype", [(64, 1, "float16"), (64, 2, "float16"),
                                                      (64, 3, "float16"), (64, 4, "float16"),
                                                      (128, 2, "bfloat16"), (128, 3, "bfloat16")])
def test_lean_full_steps(head_dim, consumers, dtype):
    """Full tiles take the lean path (no entry, no mask decision) only where every key of
    the tile is in the run: a length ending inside a full tile, 0/1 key bits and a bias
    keep the masked path; soft-capping applies on both. Walks of 40 tiles, split rows."""
    from stofc.kernels.attention.ws_plan import FULL, plan_ws
    L = 2560
    dense = _mixed_tile_mask(L, _seed("wslean", "mask"))
    fmt = format_from_dense(dense, 64)
    plan = plan_ws(fmt, split_tiles=0, consumers=consumers)
    walk = plan.entry_part.reshape(-1, consumers)
    assert (walk == FULL).sum() > 0.5 * walk.size and (walk >= 0).any()
    rng = np.random.default_rng(_seed("wslean", head_dim, consumers))
    key_mask = (rng.random((2, L)) < 0.97).astype(np.int32)
    cases = [dict(),
             dict(seq_lens=[L, 2500]),                  # 2500 ends inside tile 39
             dict(key_mask=key_mask),
             dict(softcap=20.0, score_scale=8.0),
             dict(bias_shape=(1, 2, L, L), seq_lens=[2300, L])]
    for i, kw in enumerate(cases):
        for split in (0, 8):
            res = run_case(fmt, dense, ws(split=split, consumers=consumers), batch=2, heads=2,
                           seq=L, head_dim=head_dim, dtype=dtype,
                           seed=_seed("wslean", head_dim, consumers, i, split), **kw)
            _check(res, dtype, f"{kw} split={split}")


def _full_tile_mask(L: int, seed: int, consumers: int) -> np.ndarray:
    """A block mask of whole 64 x 64 tiles (a third of them, and the diagonal), the same in
    the ``consumers`` tile rows of a block: every walk entry a full tile of each warpgroup,
    walks of different lengths."""
    rng = np.random.default_rng(seed)
    t = L // 64
    kind = np.repeat(rng.random((t // consumers, t)) < 0.33, consumers, axis=0)
    for p in range(0, t, consumers):                      # the block's diagonal tiles
        kind[p:p + consumers, p:p + consumers] = True
    return np.kron(kind, np.ones((64, 64), bool))


LEAN_L = 2304                        # 64 x 36: whole pair rows for one to four consumers


@pytest.mark.parametrize("mask,head_dim,consumers,kstep,dtype", [
    ("dense", 64, 4, 1, "float16"), ("dense", 64, 3, 1, "bfloat16"), ("dense", 64, 1, 1, "float16"),
    ("dense", 64, 2, 2, "float16"), ("dense", 64, 2, 1, "bfloat16"),
    ("bigbird:block=64,window=3,global=2,random=3,seed=0", 64, 1, 1, "float16"),
    ("bigbird:block=64,window=3,global=2,random=3,seed=0", 64, 1, 1, "bfloat16"),
    ("tiles", 64, 1, 1, "float16"), ("tiles", 64, 2, 1, "bfloat16")])
def test_lean_walks(mask, head_dim, consumers, kstep, dtype):
    """Walks whose every entry is a full tile of each warpgroup run the lean kernel at
    head_dim 64 (ws_plan.lean_walk: the consumers read no walk entries and mask only the
    keys past the run in a work's last step). Lengths ending inside a tile or inside a
    work's first tile, a run shorter than L_max, split rows and their chunks, soft-capping
    and GQA; 0/1 key bits and a bias compile the lean path out of the same config's kernel."""
    from stofc.kernels.attention.ws_launch import with_lean_walk

    if mask == "tiles":
        dense = _full_tile_mask(LEAN_L, _seed("wsleanwalk", "tiles"), consumers)
        fmt = format_from_dense(dense, 64)
    else:
        fmt, dense = encoded(mask, LEAN_L)
    rng = np.random.default_rng(_seed("wsleanwalk", mask, head_dim, consumers, kstep))
    key_mask = (rng.random((2, LEAN_L)) < 0.97).astype(np.int32)
    cases = [dict(),
             dict(seq_lens=[LEAN_L, 2250]),             # 2250 ends inside the last tile
             dict(seq_lens=[1000, 37]),                 # keys end in a work's first tile
             dict(softcap=20.0, score_scale=8.0),
             dict(kv_heads=1),
             dict(key_mask=key_mask),
             dict(bias_shape=(1, 2, LEAN_L, LEAN_L), seq_lens=[2100, LEAN_L])]
    for split in (0, 8):
        cfg = with_lean_walk(fmt, ws(split=split, kstep=kstep, consumers=consumers), head_dim)
        assert cfg.lean_walk, f"{mask} consumers={consumers} split={split}: not a lean walk"
        for i, kw in enumerate(cases):
            res = run_case(fmt, dense, cfg, batch=2, heads=2, seq=LEAN_L, head_dim=head_dim,
                           dtype=dtype, seed=_seed("wsleanwalk", mask, head_dim, consumers,
                                                   kstep, split, i), **kw)
            _check(res, dtype, f"{mask} {kw} split={split}")
        res = run_case(fmt, dense, cfg, batch=3, heads=2, seq=1111, head_dim=head_dim,
                       dtype=dtype, seed=_seed("wsleanwalk-short", mask, head_dim, split))
        _check(res, dtype, f"{mask} run of 1111 split={split}")


# ---------------------------------------------------------------- one consumer, three blocks an SM
@pytest.mark.parametrize("stages", [2, 3])
def test_one_consumer_runs_three_blocks_an_sm(stages):
    """A one-consumer block (256 threads, 80 registers at entry, ~54-71 KB of shared memory)
    is launched on a persistent grid of three blocks an SM, and the driver holds three on
    one SM once the loader asked for the largest shared-memory carveout; its output is
    right on a launch with more works than blocks."""
    import cupy as cp
    from cupy.cuda import driver

    from stofc.kernels.attention.ws_smem import ws_smem_bytes
    from stofc.runtime.attention import AttentionOp

    profile = detect()
    dtype, B, H, L = "float16", 2, 12, 4096
    fmt, dense = encoded("bigbird:block=64,window=3,global=1,random=2,seed=3", L)
    cfg = ws(stages=stages, split=16, consumers=1)
    assert prune(cfg, 64, profile) is None
    op = AttentionOp(fmt, cfg, dtype, 64, profile)
    rng = np.random.default_rng(_seed("wsc1x3", stages))
    q, k, v = (cp.asarray(rng.standard_normal((B, L, H, 64)).astype(np.float16)) for _ in range(3))
    out = cp.full((B, L, H, 64), np.float16(np.nan), dtype=np.float16)
    bound = op.bind(q, k, v, out)
    n_work = int(bound._keep[-1])
    assert n_work > 3 * profile.sm_count
    assert (bound.grid, bound.block) == (3 * profile.sm_count, 256)
    main = op._kernels[(False, False, False)][0]
    resident = driver.occupancyMaxActiveBlocksPerMultiprocessor(
        main.function.ptr, 256, ws_smem_bytes(stages, 64, 1))
    assert resident == 3
    bound.launch()
    cp.cuda.runtime.deviceSynchronize()
    res = run_case(fmt, dense, cfg, batch=B, heads=H, seq=L, head_dim=64, dtype=dtype,
                   seed=_seed("wsc1x3run", stages))
    _check(res, dtype, f"stages={stages}")
    assert not cp.isnan(out).any()
