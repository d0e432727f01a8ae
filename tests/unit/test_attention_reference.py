"""The float64 reference, the dense<->format oracle and the gathered walk list."""

from __future__ import annotations

import numpy as np
import pytest

from stofc.kernels.attention import dense_from_format, format_from_dense, reference_attention
from stofc.kernels.attention.gather import (
    column_occupancy,
    pack_bits,
    plan_tiles,
    plan_to_dense,
    unpack_bits,
)
from stofc.kernels.attention.permute import choose_permutation, permuted_plan
from stofc.kernels.attention.reference import from_bf16_bits, key_valid, to_bf16_bits
from stofc.masks import encode


def _inputs(rng, b=2, n=37, h=3, d=16):
    return (rng.standard_normal((b, n, h, d)) for _ in range(3))


def test_reference_equals_softmax_formula():
    rng = np.random.default_rng(1)
    q, k, v = _inputs(rng)
    mask = rng.random((37, 37)) < 0.5
    mask[:, 0] = True
    out = reference_attention(q, k, v, mask, 0.3)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * 0.3
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert np.allclose(out, np.einsum("bhqk,bkhd->bqhd", p, v))


def test_reference_rows_without_keys_are_zero_and_padding_drops_keys():
    rng = np.random.default_rng(2)
    q, k, v = _inputs(rng)
    mask = np.ones((37, 37), dtype=bool)
    mask[5] = False
    out = reference_attention(q, k, v, mask, 0.25, seq_lens=[37, 10])
    assert np.all(out[:, 5] == 0) and np.isfinite(out).all()
    k2, v2 = k.copy(), v.copy()
    k2[1, 10:] = 1e3
    v2[1, 10:] = -1e3                      # padding keys must not matter
    out2 = reference_attention(q, k2, v2, mask, 0.25, seq_lens=[37, 10])
    assert np.allclose(out, out2)
    km = np.ones((2, 40), dtype=np.int32)
    km[0, 3] = 0
    assert key_valid(2, 37, key_mask=km, seq_lens=[37, 10]).sum() == 36 + 10
    allkeys = reference_attention(q, k, v, mask, 0.25, key_mask=np.zeros((2, 37)))
    assert np.all(allkeys == 0)


def test_reference_bias_broadcasts():
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng)
    mask = np.ones((37, 37), dtype=bool)
    bias = rng.standard_normal((1, 3, 37, 37))
    a = reference_attention(q, k, v, mask, 0.5, bias=bias)
    b = reference_attention(q, k, v, mask, 0.5, bias=np.broadcast_to(bias, (2, 3, 37, 37)))
    assert np.allclose(a, b) and not np.allclose(a, reference_attention(q, k, v, mask, 0.5))


@pytest.mark.parametrize("tile", [16, 64, 128])
def test_format_from_dense_roundtrip_and_counts(tile):
    rng = np.random.default_rng(tile)
    dense = rng.random((2, 150, 150)) < 0.1
    dense[1, :, :20] = True
    fmt = format_from_dense(dense, tile)
    assert fmt.num_heads == 2 and fmt.nnz == dense.sum()
    assert np.array_equal(dense_from_format(fmt), dense)
    assert fmt.row_nnz.sum() == dense.sum()


@pytest.mark.parametrize("spec", ["causal", "strided:stride=48", "longformer:window=30,global=8",
                                  "bigbird:block=16,window=3,global=1,random=2,seed=4"])
def test_oracle_agrees_with_the_encoder(spec):
    fmt = encode(spec, 300, tile=64)
    again = format_from_dense(dense_from_format(fmt), 64)
    for name in ("load_row_ptr", "load_col_idx", "full_col_idx", "part_col_idx", "part_bitmaps"):
        assert np.array_equal(getattr(fmt, name), getattr(again, name)), name


def test_bits_pack_unpack_and_column_occupancy():
    rng = np.random.default_rng(5)
    bits = rng.random((3, 64, 64)) < 0.05
    assert np.array_equal(unpack_bits(pack_bits(bits), 64), bits)
    assert np.array_equal(column_occupancy(pack_bits(bits), 64), bits.any(axis=1))


@pytest.mark.parametrize("spec,L,tile", [("strided:stride=128", 1000, 64),
                                         ("global:tokens=[3,70,900]", 1000, 64),
                                         ("bigbird:block=64,window=3,global=2,random=3,seed=0", 1000, 128)])
def test_gathered_plan_walks_exactly_the_mask(spec, L, tile):
    fmt = encode(spec, L, tile=tile)
    plan = plan_tiles(fmt, gather=True)
    assert plan.gathered > 0
    assert plan.key_base.size < fmt.load_col_idx.size
    assert np.array_equal(plan_to_dense(plan, L), dense_from_format(fmt))
    # gathered entries first, then ascending contiguous tiles (the kernel relies on it)
    for r in range(fmt.tile_rows):
        kb = plan.key_base[plan.row_ptr[0, r]:plan.row_ptr[0, r + 1]]
        neg = kb < 0
        assert not np.any(np.diff(neg.astype(int)) > 0)
        assert np.all(np.diff(kb[~neg]) > 0)


def test_plan_without_gather_is_the_load_list():
    fmt = encode("sliding:window=100", 700)
    plan = plan_tiles(fmt, gather=False)
    assert np.array_equal(plan.key_base, fmt.load_col_idx * 64)
    assert np.array_equal(plan.part_idx, fmt.load_part_idx)
    assert plan.gathered == 0


def test_per_head_plan():
    rng = np.random.default_rng(6)
    dense = rng.random((3, 200, 200)) < 0.02
    dense[0, :, 7] = True
    fmt = format_from_dense(dense, 64)
    plan = plan_tiles(fmt, gather=True)
    assert np.array_equal(plan_to_dense(plan, 200), dense)


def test_bf16_bits_roundtrip():
    x = np.array([1.0, -2.5, 3.140625, 1e-3], dtype=np.float32)
    assert np.allclose(from_bf16_bits(to_bf16_bits(x)), x, rtol=4e-3)


@pytest.mark.parametrize("spec,period", [("dilated:window=256,dilation=2", 2),
                                         ("dilated:window=300,dilation=3,causal=true", 3)])
def test_residue_permutation_densifies_dilation_and_keeps_the_mask(spec, period):
    fmt = encode(spec, 1000)
    chosen = choose_permutation(fmt)
    assert chosen is not None and chosen[0] == period
    _, perm, pfmt = chosen
    assert np.array_equal(np.sort(perm), np.arange(1000))
    plan = permuted_plan(pfmt, perm, gather=True)
    assert plan.key_base.size < 0.75 * plan_tiles(fmt).key_base.size
    assert np.all(plan.key_base < 0)                      # every tile gathered by real key
    dense = dense_from_format(fmt)
    assert np.array_equal(plan_to_dense(plan, 1000), dense[:, perm, :])


@pytest.mark.parametrize("spec", ["causal", "sliding:window=128", "strided:stride=64"])
def test_no_permutation_where_it_does_not_pay(spec):
    assert choose_permutation(encode(spec, 1000)) is None
