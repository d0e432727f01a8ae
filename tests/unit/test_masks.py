"""The encoder against the independent reference: random specs, compositions, heads, tiles.

Every test decodes the unified format and compares it element for element with
``test_mask_reference.tree_dense`` (a plain numpy evaluation of MASKS.md), and
checks the format's invariants.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stofc.masks.encoder as encode_mod
import stofc.masks.predicates as pred_mod
from stofc.masks import encode, parse_mask, stats, tile_classes, to_dense
from stofc.masks.format import MaskFormat
from stofc.masks.spec import Combine, Family, MaskSpec
from tests.unit.test_mask_reference import tree_dense

TILES = (16, 32, 64, 128)
MAX_L = 300
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


# ------------------------------------------------------------------ format invariants


def _unpack(words: np.ndarray, tile: int) -> np.ndarray:
    """Independent unpacking straight from the format's docstring."""
    g = tile // 8
    out = np.zeros((tile, tile), dtype=bool)
    for ic, ir in itertools.product(range(g), range(g)):
        word = int(words[ic * g + ir])
        for bit in range(64):
            if word >> bit & 1:
                out[ir * 8 + bit // 8, ic * 8 + bit % 8] = True
    return out


def check_format(fmt: MaskFormat, dense_heads: list[np.ndarray], exhaustive_bits: bool = False):
    """Decoding gives the reference, and every MaskFormat invariant holds."""
    L, T, H = fmt.seq_len, fmt.tile, fmt.num_heads
    R = -(-L // T)
    assert fmt.tile_rows == R and len(dense_heads) == H
    for name, dtype in (("full_row_ptr", np.int32), ("full_col_idx", np.int32),
                        ("part_row_ptr", np.int32), ("part_col_idx", np.int32),
                        ("part_bitmaps", np.uint64), ("load_row_ptr", np.int32),
                        ("load_col_idx", np.int32), ("load_part_idx", np.int32),
                        ("row_nnz", np.int64)):
        arr = getattr(fmt, name)
        assert arr.dtype == dtype, name
        assert not arr.flags.writeable, name
    assert fmt.part_bitmaps.shape == (len(fmt.part_col_idx), (T // 8) ** 2)
    for ptr_name, n in (("full_row_ptr", len(fmt.full_col_idx)),
                        ("part_row_ptr", len(fmt.part_col_idx)),
                        ("load_row_ptr", len(fmt.load_col_idx))):
        ptr = getattr(fmt, ptr_name)
        assert ptr.shape == (H, R + 1)
        assert ptr[0, 0] == 0 and ptr[-1, -1] == n
        assert (np.diff(ptr, axis=1) >= 0).all()
        assert (ptr[1:, 0] == ptr[:-1, -1]).all()  # heads are contiguous, global offsets
    assert len(fmt.load_col_idx) == len(fmt.full_col_idx) + len(fmt.part_col_idx)
    total = 0
    for h in range(H):
        want = dense_heads[h]
        got = to_dense(fmt, h)
        assert got.shape == (L, L)
        assert (got == want).all(), f"head {h}: {np.argwhere(got != want)[:5].tolist()}"
        padded = np.zeros((R * T, R * T), dtype=bool)
        padded[:L, :L] = want
        tiles = padded.reshape(R, T, R, T).transpose(0, 2, 1, 3)
        inside = np.zeros((R * T, R * T), dtype=bool)
        inside[:L, :L] = True
        inside_tiles = inside.reshape(R, T, R, T).transpose(0, 2, 1, 3)
        cls = tile_classes(fmt, h)
        for r in range(R):
            f = fmt.full_col_idx[fmt.full_row_ptr[h, r]:fmt.full_row_ptr[h, r + 1]]
            p = fmt.part_col_idx[fmt.part_row_ptr[h, r]:fmt.part_row_ptr[h, r + 1]]
            lo, hi = fmt.load_row_ptr[h, r], fmt.load_row_ptr[h, r + 1]
            lc, lp = fmt.load_col_idx[lo:hi], fmt.load_part_idx[lo:hi]
            for cols in (f, p, lc):
                assert (np.diff(cols) > 0).all()  # sorted, unique
                assert ((cols >= 0) & (cols < R)).all()
            assert not set(f) & set(p)  # a full tile has no bitmap
            assert list(lc) == sorted(set(f) | set(p))  # load = full U part
            for c, pi in zip(lc, lp, strict=True):
                if pi < 0:
                    assert c in set(f)
                else:
                    assert fmt.part_col_idx[pi] == c
                    assert fmt.part_row_ptr[h, r] <= pi < fmt.part_row_ptr[h, r + 1]
            for c in range(R):
                n_in = int(inside_tiles[r, c].sum())
                n_on = int(tiles[r, c].sum())
                expected = 2 if n_on == n_in else (1 if n_on else 0)
                assert cls[r, c] == expected, (h, r, c)
            assert fmt.row_nnz[h, r] == int(want[r * T:(r + 1) * T].sum())
        p0, p1 = fmt.part_row_ptr[h, 0], fmt.part_row_ptr[h, -1]
        prow = np.repeat(np.arange(R), np.diff(fmt.part_row_ptr[h]))
        for i in range(p0, p1):
            words = fmt.part_bitmaps[i]
            r, c = prow[i - p0], fmt.part_col_idx[i]
            bits = tiles[r, c]
            assert bits.any() and not (bits == inside_tiles[r, c]).all()  # neither empty nor full
            if exhaustive_bits or i == p0:
                assert (_unpack(words, T) == bits).all()  # layout, incl. zero out-of-range bits
        total += int(want.sum())
    assert fmt.nnz == total
    assert abs(fmt.density - total / (H * L * L)) < 1e-12


# ------------------------------------------------------------------ random specs


@pytest.fixture(scope="module")
def npy_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mask_npy")


def _save_bool(directory: Path, arr: np.ndarray, tag: str) -> str:
    path = directory / f"{tag}_{abs(hash(arr.tobytes())):x}.npy"
    np.save(path, arr)
    return str(path)


@st.composite
def leaves(draw, directory: Path, heads: int | None = None):
    name = draw(st.sampled_from(["dense", "causal", "sliding", "global", "longformer", "bigbird",
                                 "strided", "dilated", "blocksparse", "bitmap"]))
    small = st.integers(0, 80)
    p: dict = {}
    if name == "sliding":
        p = {"window": draw(small)}
    elif name == "global":
        p = ({"first": draw(small)} if draw(st.booleans())
             else {"tokens": draw(st.lists(st.integers(0, MAX_L + 20), max_size=5))})
    elif name == "longformer":
        p = {"window": draw(small), "global": draw(st.integers(0, 20))}
    elif name == "bigbird":
        p = {"block": draw(st.integers(1, 48)), "window": draw(st.sampled_from([1, 3, 5, 7])),
             "global": draw(st.integers(0, 3)), "random": draw(st.integers(0, 4)),
             "seed": draw(st.integers(0, 2**31 - 1))}
    elif name == "strided":
        p = {"stride": draw(st.integers(1, 80))}
    elif name == "dilated":
        p = {"window": draw(small), "dilation": draw(st.integers(1, 6))}
    elif name in ("blocksparse", "bitmap"):
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        density = draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
        lead = (heads,) if heads else ()
        if name == "blocksparse":
            block = draw(st.integers(1, 64))
            nb = -(-MAX_L // block) + draw(st.integers(0, 2))
            arr = rng.random((*lead, nb, nb)) < density
            p = {"block": block, "layout": _save_bool(directory, arr, "layout")}
        else:
            n = MAX_L + draw(st.integers(0, 5))
            arr = rng.random((*lead, n, n)) < density
            p = {"file": _save_bool(directory, arr, "bitmap")}
    if draw(st.booleans()):
        p["causal"] = draw(st.booleans())
    if draw(st.booleans()) and "causal" not in p and name != "causal":
        return {name: p, "causal": draw(st.booleans())}  # modifier at the level
    return {name: p}


def trees(directory: Path, heads: int | None = None):
    return st.recursive(
        leaves(directory, heads),
        lambda kids: st.builds(
            lambda op, items, causal: {op: items, **({"causal": True} if causal else {})},
            st.sampled_from(["union", "intersect", "subtract"]),
            st.lists(kids, min_size=1, max_size=3), st.booleans()),
        max_leaves=4)


def _write_yaml(directory: Path, doc: dict) -> str:
    text = yaml.safe_dump(doc, sort_keys=False)
    path = directory / f"spec_{abs(hash(text)):x}.yaml"
    path.write_text(text)
    return str(path)


@SETTINGS
@given(data=st.data(), L=st.integers(1, MAX_L), tile=st.sampled_from(TILES))
def test_random_specs_decode_to_reference(npy_dir, data, L, tile):
    tree = data.draw(trees(npy_dir))
    spec = parse_mask(_write_yaml(npy_dir, {"mask": tree}))
    fmt = encode(spec, L, tile=tile)
    assert fmt.num_heads == 1
    check_format(fmt, [tree_dense(tree, L)])


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), L=st.integers(1, 200), tile=st.sampled_from(TILES),
       cells=st.sampled_from([1, 3, 17]), batch=st.sampled_from([1, 100, 700]))
def test_chunked_encoding_is_the_same(npy_dir, monkeypatch, data, L, tile, cells, batch):
    """Tiny chunks of tile rows and tiny evaluation batches give the same arrays."""
    tree = data.draw(trees(npy_dir))
    spec = parse_mask(_write_yaml(npy_dir, {"mask": tree}))
    whole = encode(spec, L, tile=tile)
    monkeypatch.setattr(encode_mod, "_GRID_CELLS", cells)
    monkeypatch.setattr(pred_mod, "_BATCH_ELEMS", batch)
    chunked = encode(spec, L, tile=tile)
    for name in ("full_row_ptr", "full_col_idx", "part_row_ptr", "part_col_idx",
                 "part_bitmaps", "load_row_ptr", "load_col_idx", "load_part_idx", "row_nnz"):
        assert getattr(whole, name).tobytes() == getattr(chunked, name).tobytes(), name
    check_format(chunked, [tree_dense(tree, L)])


def _cli_text(tree: dict) -> str | None:
    (name,) = [k for k, v in tree.items() if not (k == "causal" and isinstance(v, bool))]
    params = dict(tree[name])
    if isinstance(tree.get("causal"), bool):
        params["causal"] = tree["causal"]
    items = []
    for k, v in params.items():
        if isinstance(v, bool):
            items.append(f"{k}={'true' if v else 'false'}")
        elif isinstance(v, list):
            items.append(f"{k}=[{','.join(map(str, v))}]")
        else:
            items.append(f"{k}={v}")
    return name + (":" + ",".join(items) if items else "")


@SETTINGS
@given(data=st.data(), L=st.integers(1, MAX_L), tile=st.sampled_from(TILES))
def test_command_line_form_decodes_to_reference(npy_dir, data, L, tile):
    tree = data.draw(leaves(npy_dir))
    spec = parse_mask(_cli_text(tree))
    check_format(encode(spec, L, tile=tile), [tree_dense(tree, L)])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), L=st.integers(1, 160), tile=st.sampled_from(TILES),
       num_heads=st.integers(1, 6))
def test_head_and_layer_overrides(npy_dir, data, L, tile, num_heads):
    default = data.draw(trees(npy_dir))
    head_tree = data.draw(trees(npy_dir))
    layer_tree = data.draw(trees(npy_dir))
    lo = data.draw(st.integers(0, num_heads - 1))
    hi = data.draw(st.integers(lo, num_heads - 1))
    hkey = str(lo) if lo == hi and data.draw(st.booleans()) else f"{lo}-{hi}"
    doc = {"mask": default, "layers": {"1-2": layer_tree}, "heads": {hkey: head_tree}}
    spec = parse_mask(_write_yaml(npy_dir, doc))
    assert spec.is_per_head()
    for layer in (0, 2):
        base = layer_tree if layer == 2 else default
        fmt = encode(spec, L, tile=tile, layer=layer, num_heads=num_heads)
        want = [tree_dense(head_tree if lo <= h <= hi else base, L) for h in range(num_heads)]
        if fmt.num_heads == 1:  # every head resolved to the same mask
            assert all((w == want[0]).all() for w in want)
            want = want[:1]
        else:
            assert fmt.num_heads == num_heads
        check_format(fmt, want)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), L=st.integers(1, MAX_L), tile=st.sampled_from(TILES),
       heads=st.integers(2, 4))
def test_per_head_files(npy_dir, data, L, tile, heads):
    tree = data.draw(trees(npy_dir, heads=heads))
    spec = parse_mask(_write_yaml(npy_dir, {"mask": tree}))
    uses_files = any(k in str(tree) for k in ("'layout'", "'file'"))
    assert spec.is_per_head() == uses_files
    fmt = encode(spec, L, tile=tile)
    if uses_files:
        assert fmt.num_heads == heads
        check_format(fmt, [tree_dense(tree, L, h) for h in range(heads)])
    else:
        check_format(fmt, [tree_dense(tree, L)])


@pytest.mark.parametrize("tile", TILES)
def test_every_bit_of_every_part_tile(tile):
    """Exhaustive bit layout check (column-major ITs, bit r*8+c) on a mixed mask."""
    tree = {"union": [{"sliding": {"window": 5}}, {"strided": {"stride": 7}}], "causal": True}
    for L in (tile + 3, 2 * tile):
        node = Combine("union", (Family("sliding", (("window", 5),)),
                                 Family("strided", (("stride", 7),))), causal=True)
        fmt = encode(MaskSpec(node), L, tile=tile)
        check_format(fmt, [tree_dense(tree, L)], exhaustive_bits=True)


@pytest.mark.parametrize("text", ["causal", "sliding:window=300,causal=true",
                                  "longformer:window=200,global=3",
                                  "bigbird:block=32,window=3,global=2,random=3,seed=5",
                                  "strided:stride=100", "dilated:window=256,dilation=3"])
def test_longer_sequences(text):
    L = 2000
    check_format(encode(parse_mask(text), L, tile=64), [tree_dense(text, L)])


def test_stats_match_the_format():
    fmt = encode(parse_mask("sliding:window=70"), 500, tile=32)
    s = stats(fmt)
    dense = to_dense(fmt)
    cls = tile_classes(fmt)
    assert s.nnz == int(dense.sum()) and s.density == pytest.approx(dense.mean())
    assert (s.tiles_full, s.tiles_part, s.tiles_empty) == (
        int((cls == 2).sum()), int((cls == 1).sum()), int((cls == 0).sum()))
    assert s.bitmap_bytes == s.tiles_part * 16 * 8
    n16 = -(-500 // 16)
    padded = np.zeros((n16 * 16, n16 * 16), dtype=bool)
    padded[:500, :500] = dense
    assert s.blocks16_nonempty == int(padded.reshape(n16, 16, n16, 16).any(axis=(1, 3)).sum())
    assert s.row_nnz[0] == tuple(int(dense[r * 32:(r + 1) * 32].sum()) for r in range(16))


@pytest.mark.parametrize("text", ["causal", "sliding:window=9", "global:first=4",
                                  "bigbird:block=8,window=3,global=1,random=2,seed=3",
                                  "strided:stride=6", "dilated:window=12,dilation=4"])
def test_predicate_allowed_broadcasts(text):
    from stofc.masks import predicate

    L = 70
    q, k = np.arange(L)[:, None], np.arange(L)[None, :]
    got = predicate(text, L).allowed(q, k)
    assert got.shape == (L, L) and (got == tree_dense(text, L)).all()
    assert predicate(text, L).allowed(np.array(5), np.array(3)) == tree_dense(text, L)[5, 3]


@pytest.mark.parametrize("text", ["sliding:window=256,causal=true",
                                  "bigbird:block=64,window=3,global=2,random=3",
                                  "longformer:window=128,global=2"])
def test_long_sequences_never_go_dense(text):
    """L_max = 65536: a dense mask would be 4 GiB; the encoder stays near the format's size."""
    import tracemalloc

    tracemalloc.start()
    fmt = encode(parse_mask(text), 65536, tile=64)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    s = stats(fmt)
    assert peak < 4 * s.format_bytes + (8 << 20), (peak, s.format_bytes)
    assert s.tiles_full + s.tiles_part + s.tiles_empty == 1024 * 1024
