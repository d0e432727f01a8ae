"""BigBird's random blocks (MASKS.md): counts, distinctness, exclusions, determinism, uniformity."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stofc.masks import bigbird_random_blocks, encode, parse_mask, to_dense


@settings(max_examples=80, deadline=None)
@given(L=st.integers(1, 3000), block=st.integers(1, 300), window=st.sampled_from([1, 3, 5, 9]),
       first=st.integers(0, 4), count=st.integers(0, 6), seed=st.integers(0, 2**32 - 1))
def test_counts_distinct_and_outside_window_and_global(L, block, window, first, count, seed):
    nb = -(-L // block)
    rand = bigbird_random_blocks(L, block, window, first, count, seed)
    assert rand.shape == (nb, count) and rand.dtype == np.int64
    half = window // 2
    for i in range(nb):
        row = rand[i][rand[i] >= 0]
        assert (rand[i][len(row):] == -1).all()  # padding only at the end
        if i < first:
            assert len(row) == 0  # global rows are dense already
            continue
        free = sum(1 for j in range(nb) if abs(i - j) > half and j >= first)
        assert len(row) == min(count, free)
        assert len(set(row.tolist())) == len(row)
        assert (np.diff(row) > 0).all()
        for j in row:
            assert 0 <= j < nb and abs(i - j) > half and j >= first


def test_draw_is_deterministic_and_seed_dependent():
    a = bigbird_random_blocks(4096, 64, 3, 2, 3, 7)
    b = bigbird_random_blocks(4096, 64, 3, 2, 3, 7)
    c = bigbird_random_blocks(4096, 64, 3, 2, 3, 8)
    assert a.tobytes() == b.tobytes()
    assert a.tobytes() != c.tobytes()
    # The draw of row i depends on (seed, i, L_max, b, w, g): another L_max changes it.
    d = bigbird_random_blocks(4096 + 64, 64, 3, 2, 3, 7)
    assert d[:64].tobytes() != a.tobytes()


def test_same_spec_gives_byte_identical_formats_and_other_seed_differs():
    text = "bigbird:block=32,window=3,global=1,random=2,seed={}"
    f1 = encode(parse_mask(text.format(11)), 1000, tile=64)
    f2 = encode(parse_mask(text.format(11)), 1000, tile=64)
    f3 = encode(parse_mask(text.format(12)), 1000, tile=64)
    names = ("full_col_idx", "part_col_idx", "part_bitmaps", "load_col_idx", "row_nnz")
    assert all(getattr(f1, n).tobytes() == getattr(f2, n).tobytes() for n in names)
    assert f1.spec_hash == f2.spec_hash != f3.spec_hash
    assert (to_dense(f1) != to_dense(f3)).any()


def test_draw_is_uniform_over_free_blocks():
    """Each free block of a row is picked with probability r / free (chi-square, 4000 seeds)."""
    nb, count, first, window = 10, 3, 1, 3
    i = 6
    free = [j for j in range(nb) if abs(i - j) > 1 and j >= first]  # 1,2,3,4,8,9
    hits = np.zeros(nb)
    seeds = 4000
    for seed in range(seeds):
        rand = bigbird_random_blocks(nb, 1, window, first, count, seed)
        hits[rand[i]] += 1
    expected = seeds * count / len(free)
    observed = hits[free]
    assert hits.sum() == seeds * count and set(np.flatnonzero(hits)) <= set(free)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 degrees of freedom: p ~ 0.001


def test_raw_stream_is_the_documented_generator():
    """Row i uses Generator(PCG64(SeedSequence([seed, i, L, b, w, g]))) (cross-machine rule)."""
    L, b, w, g, r, seed = 640, 64, 3, 1, 1, 5
    rand = bigbird_random_blocks(L, b, w, g, r, seed)
    i = 5
    gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, i, L, b, w, g])))
    x = int(gen.bit_generator.random_raw())
    free = [j for j in range(L // b) if abs(i - j) > 1 and j >= g]  # 1, 2, 3, 7, 8, 9
    bound = len(free)
    assert x < (1 << 64) - ((1 << 64) % bound)  # no rejection for this seed
    assert rand[i, 0] == free[x % bound]
