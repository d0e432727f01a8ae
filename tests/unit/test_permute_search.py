"""The residue-permutation search: window pairs instead of the dense mask, one search per
mask content, and one kernel selection per (mask, shape) for all layers sharing it."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from stofc.kernels.attention import permute, select
from stofc.kernels.attention.permute import choose_permutation, permute_format
from stofc.kernels.attention.reference import dense_from_format, format_from_dense
from stofc.masks import encode
from stofc.targets import get_profile

FIELDS = ("full_row_ptr", "full_col_idx", "part_row_ptr", "part_col_idx", "part_bitmaps",
          "load_row_ptr", "load_col_idx", "load_part_idx", "row_nnz")


def _same(a, b) -> bool:
    return a.nnz == b.nnz and all(np.array_equal(getattr(a, f), getattr(b, f)) for f in FIELDS)


@pytest.mark.parametrize("spec,n,tile", [
    ("dilated:window=256,dilation=2", 1000, 64),
    ("bigbird:block=64,window=3,global=2,random=3", 1000, 64),
    ("sliding:window=100", 777, 64),                  # last window and tile partial
    ("dilated:window=300,dilation=3,causal=true", 1500, 128),
])
def test_permuted_format_equals_the_dense_route(spec, n, tile):
    fmt = encode(spec, n, tile=tile)
    dense = dense_from_format(fmt)
    for d in permute.PERIODS:
        perm = permute.residue_permutation(n, tile, d)
        assert _same(permute_format(fmt, perm, d),
                     format_from_dense(dense[:, perm][:, :, perm], tile)), d


def test_permuted_format_per_head():
    q = np.arange(600)
    dil = ((q[:, None] - q[None, :]) % 2 == 0) & (np.abs(q[:, None] - q[None, :]) < 200)
    band = np.abs(q[:, None] - q[None, :]) < 90
    fmt = format_from_dense(np.stack([dil, band]), 64)
    perm = permute.residue_permutation(600, 64, 3)
    dense = np.stack([dil, band])
    assert _same(permute_format(fmt, perm, 3),
                 format_from_dense(dense[:, perm][:, :, perm], 64))


def test_the_search_at_8k_follows_the_tiles_not_l_squared():
    """ModernBERT's local layers at 8192 (+-64, T=64): the search used to decode the
    8192 x 8192 mask three times (17-22 s per layer); now it decodes the window pairs."""
    fmt = encode("sliding:window=64", 8192)
    permute._MEMO.clear()
    tracemalloc.start()
    start = time.perf_counter()
    assert choose_permutation(fmt) is None
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8192 * 8192 // 2, peak   # half of one L x L bool array (28 MB measured:
    #                                        the permuted tiles themselves; was > 3 L x L)
    assert elapsed < 10.0, elapsed                 # 0.3 s measured (was 21.7 s)


def test_layers_with_the_same_mask_share_one_search(monkeypatch):
    calls = []
    real = permute._search
    monkeypatch.setattr(permute, "_search", lambda fmt: calls.append(fmt) or real(fmt))
    permute._MEMO.clear()
    a = encode("dilated:window=256,dilation=2", 1024)
    b = encode("dilated:window=256,dilation=2", 1024)          # another object, same content
    first = choose_permutation(a)
    assert first is not None and choose_permutation(b) is first and len(calls) == 1
    assert not first[1].flags.writeable                         # shared: read-only
    choose_permutation(encode("dilated:window=256,dilation=2", 2048))
    assert len(calls) == 2                                      # another content: searched


def test_one_selection_per_mask_and_shape(monkeypatch):
    calls = []
    real = select._select
    monkeypatch.setattr(select, "_select", lambda *a, **k: calls.append(k) or real(*a, **k))
    select._MEMO.clear()
    profile = get_profile("h100")
    shape = {"batch": 1, "heads": 12, "seq_len": 4096, "head_dim": 64}
    picks = [select.select_kernel(encode("sliding:window=64", 4096), profile, **shape)
             for _ in range(14)]
    assert len(calls) == 1 and all(p is picks[0] for p in picks)
    select.select_kernel(encode("sliding:window=64", 4096), profile,
                         **{**shape, "batch": 2})
    select.select_kernel(encode("sliding:window=32", 4096), profile, **shape)
    assert len(calls) == 3                       # the batch and the mask are in the key
