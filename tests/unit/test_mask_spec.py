"""Parsing mask specs: canonical form, hashing, overrides, and every kind of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stofc.errors import MaskSpecError
from stofc.masks import encode, load, parse_mask, save, stats, to_dense


def _yaml(tmp_path: Path, text: str, name: str = "spec.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_canonical_form_is_order_and_default_independent(tmp_path):
    a = parse_mask("bigbird:seed=0,random=3,global=2,window=3,block=64")
    b = parse_mask("bigbird:block=64,window=3,global=2,random=3")  # seed defaults to 0
    assert a.canonical() == b.canonical() and a.hash == b.hash
    assert json.loads(a.canonical()) == {"mask": {"bigbird": {
        "block": 64, "global": 2, "random": 3, "seed": 0, "window": 3}}}
    y = parse_mask(_yaml(tmp_path, "mask:\n  bigbird: {window: 3, block: 64, global: 2, "
                                   "random: 3, seed: 0}\n"))
    assert y.canonical() == a.canonical()
    assert parse_mask("sliding:window=4,causal=true").hash != parse_mask("sliding:window=4").hash
    assert parse_mask("global:tokens=[5,1,5]").canonical() == \
        parse_mask("global:tokens=[1,5]").canonical()


def test_file_specs_are_named_by_content_not_path(tmp_path):
    layout = np.eye(4, dtype=bool)
    np.save(tmp_path / "a.npy", layout)
    np.save(tmp_path / "b.npy", layout)
    a = parse_mask(f"blocksparse:layout={tmp_path / 'a.npy'},block=16")
    b = parse_mask(f"blocksparse:layout={tmp_path / 'b.npy'},block=16")
    assert a.hash == b.hash and "a.npy" not in a.canonical()
    np.save(tmp_path / "b.npy", ~layout)
    assert parse_mask(f"blocksparse:layout={tmp_path / 'b.npy'},block=16").hash != a.hash


def test_yaml_example_from_masks_md(tmp_path):
    path = _yaml(tmp_path, """
mask:                      # the default for every layer and head
  union:
    - sliding: {window: 128}
    - global: {tokens: [0, 17, 255]}
  causal: true
layers:                    # optional overrides, by layer index or range
  "0-3": {dilated: {window: 256, dilation: 2}}
heads:                     # optional overrides, by head index or range
  "8-11": {bigbird: {block: 64, window: 3, global: 1, random: 2, seed: 7}}
""")
    spec = parse_mask(path)
    assert spec.is_per_head()
    layer5 = spec.for_layer(5, 12)
    assert len(layer5.heads) == 12 and layer5.heads[0] == layer5.heads[7] != layer5.heads[8]
    assert spec.for_layer(2, 12).heads[0] != layer5.heads[0]  # layer override
    assert spec.for_layer(2, 12).heads[9] == layer5.heads[9]  # heads beat layers
    fmt = encode(spec, 300, tile=64, layer=5, num_heads=12)
    assert fmt.num_heads == 12
    q, k = np.arange(300)[:, None], np.arange(300)[None, :]
    g = np.isin(np.arange(300), [0, 17, 255])
    want = ((np.abs(q - k) <= 128) | g[:, None] | g[None, :]) & (k <= q)
    assert (to_dense(fmt, 3) == want).all()


def test_heads_resolving_alike_share_one_format(tmp_path):
    spec = parse_mask(_yaml(tmp_path, "mask: {causal: {}}\nheads:\n  0-3: {causal: {}}\n"))
    fmt = encode(spec, 100, num_heads=4)
    assert fmt.num_heads == 1


def test_save_load_round_trip_and_tamper_detection(tmp_path):
    spec = parse_mask("longformer:window=20,global=3")
    fmt = encode(spec, 333, tile=32)
    path = save(fmt, tmp_path / "m.npz")
    back = load(path)
    assert back.spec == fmt.spec and back.spec_hash == fmt.spec_hash
    assert (back.seq_len, back.tile, back.num_heads, back.nnz) == (333, 32, 1, fmt.nnz)
    for name in ("full_row_ptr", "full_col_idx", "part_row_ptr", "part_col_idx", "part_bitmaps",
                 "load_row_ptr", "load_col_idx", "load_part_idx", "row_nnz"):
        a, b = getattr(fmt, name), getattr(back, name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert (to_dense(back) == to_dense(fmt)).all()
    # A different spec under the old hash is refused.
    with np.load(path) as data:
        items = {k: data[k] for k in data.files}
    meta = json.loads(str(items["meta"]))
    meta["spec"] = meta["spec"].replace('"window":20', '"window":21')
    items["meta"] = np.array(json.dumps(meta))
    np.savez(tmp_path / "bad.npz", **items)
    with pytest.raises(MaskSpecError, match="spec hash does not match"):
        load(tmp_path / "bad.npz")
    # Edited arrays are refused too.
    items["meta"] = np.array(json.dumps(json.loads(str(np.load(path)["meta"]))))
    items["full_col_idx"] = items["full_col_idx"] + 1
    np.savez(tmp_path / "bad2.npz", **items)
    with pytest.raises(MaskSpecError, match="digest"):
        load(tmp_path / "bad2.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(MaskSpecError, match="not a stofc mask"):
        load(tmp_path / "junk.npz")


def _err(text: str) -> str:
    with pytest.raises(MaskSpecError) as info:
        parse_mask(text)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize(("text", "needles"), [
    ("slidng:window=3", ["unknown mask family 'slidng'", "sliding"]),
    ("sliding:windw=3", ["unknown parameter 'windw'", "sliding", "window"]),
    ("sliding", ["needs parameter 'window'", "integer >= 0"]),
    ("sliding:window=-1", ["sliding", "'window'", "integer >= 0"]),
    ("sliding:window=1.5", ["sliding", "'window'", "integer >= 0"]),
    ("sliding:window=abc", ["sliding", "'window'", "integer >= 0"]),
    ("sliding:window=99999999999", ["out of range", "integer >= 0"]),
    ("sliding:window=3,causal=yes", ["'causal'", "true or false"]),
    ("sliding:window=3,window=4", ["given twice"]),
    ("sliding:window", ["not key=value"]),
    ("strided:stride=0", ["strided", "'stride'", "integer >= 1"]),
    ("dilated:window=4,dilation=0", ["dilated", "'dilation'", "integer >= 1"]),
    ("bigbird:block=64,window=2,global=1,random=1", ["'window' = 2 is even", "odd integer"]),
    ("bigbird:block=0,window=3,global=1,random=1", ["'block'", "integer >= 1"]),
    ("global:first=1,tokens=[1]", ["exactly one of 'tokens' or 'first'"]),
    ("global", ["exactly one of 'tokens' or 'first'"]),
    ("global:tokens=[1,x]", ["'tokens'", "list of integers"]),
    ("blocksparse:block=4,layout=/nonexistent/x.npy", ["does not exist", "x.npy"]),
    ("", ["empty mask spec"]),
    ("nothere.yaml", ["does not exist", "nothere.yaml"]),
])
def test_bad_command_line_specs(text, needles):
    msg = _err(text)
    for needle in needles:
        assert needle in msg, msg


def test_bad_files(tmp_path):
    np.save(tmp_path / "f32.npy", np.ones((4, 4), dtype=np.float32))
    np.save(tmp_path / "rect.npy", np.ones((4, 5), dtype=bool))
    np.save(tmp_path / "flat.npy", np.ones(4, dtype=bool))
    (tmp_path / "junk.npy").write_text("hello")
    msg = _err(f"blocksparse:block=4,layout={tmp_path / 'f32.npy'}")
    assert "dtype float32" in msg and "f32.npy" in msg and "bool" in msg
    msg = _err(f"bitmap:file={tmp_path / 'rect.npy'}")
    assert "shape [4, 5]" in msg and "[N, N]" in msg
    assert "shape [4]" in _err(f"bitmap:file={tmp_path / 'flat.npy'}")
    assert "not a readable .npy" in _err(f"bitmap:file={tmp_path / 'junk.npy'}")
    # Too small for L_max: an error at encode time, naming the file and the needed size.
    np.save(tmp_path / "small.npy", np.ones((8, 8), dtype=bool))
    with pytest.raises(MaskSpecError, match=r"small\.npy.*L_max=100.*\[100, 100\]"):
        encode(parse_mask(f"bitmap:file={tmp_path / 'small.npy'}"), 100)
    with pytest.raises(MaskSpecError, match=r"small\.npy.*needs 25.*\[25, 25\]"):
        encode(parse_mask(f"blocksparse:block=4,layout={tmp_path / 'small.npy'}"), 100)
    # Per-head files must agree with the model's heads.
    np.save(tmp_path / "h3.npy", np.ones((3, 8, 8), dtype=bool))
    spec = parse_mask(f"blocksparse:block=4,layout={tmp_path / 'h3.npy'}")
    assert encode(spec, 32).num_heads == 3
    with pytest.raises(MaskSpecError, match="3 heads but the model has 4"):
        encode(spec, 32, num_heads=4)


@pytest.mark.parametrize(("text", "needles"), [
    ("mask:\n  sliding: {window: 3\n", ["line 3", "YAML syntax error", "started on line 2"]),
    ("mask:\n  sliding:\n  window: 3\n   causal: true\n", ["line 4", "YAML syntax error"]),
    ("mask:\n  union:\n    - sliding: {window: 3}\n    - slidng: {window: 4}\n",
     ["line 4", "unknown key 'slidng'", "sliding"]),
    ("mask:\n  sliding:\n    window: 3\n    causal: maybe\n",
     ["line 4", "'causal'", "true or false"]),
    ("mask:\n  sliding:\n    window: 3\n    windw: 4\n",
     ["line 4", "unknown parameter 'windw'", "window"]),
    ("mask:\n  sliding:\n    window: three\n", ["line 3", "'window'", "integer >= 0"]),
    ("mask:\n  sliding: {window: true}\n", ["line 2", "'window'", "integer >= 0"]),
    ("mask:\n  bigbird: {block: 8, window: 4, global: 0, random: 0}\n",
     ["line 2", "is even", "odd"]),
    ("mask:\n  union: []\n", ["line 2", "non-empty list"]),
    ("mask:\n  sliding: {window: 3}\n  dense: {}\n", ["exactly one family"]),
    ("masks:\n  dense: {}\n", ["line 1", "unknown top-level key 'masks'", "mask, layers, heads"]),
    ("layers: {}\n", ["missing key 'mask'"]),
    ("- dense\n", ["expected a mapping with key 'mask'"]),
    ("mask: {dense: {}}\nheads:\n  x-y: {causal: {}}\n", ["line 3", "not an index or range"]),
    ("mask: {dense: {}}\nheads:\n  5-2: {causal: {}}\n", ["line 3", "empty"]),
    ("mask: {dense: {}}\nheads:\n  0-3: {causal: {}}\n  2-5: {dense: {}}\n",
     ["line 4", "overlaps"]),
    ("mask: {dense: {}}\nmask: {causal: {}}\n", ["line 2", "appears twice"]),
    ("mask: 5\n", ["line 1", "expected a mask"]),
])
def test_bad_yaml(tmp_path, text, needles):
    path = _yaml(tmp_path, text)
    msg = _err(path)
    assert path in msg
    for needle in needles:
        assert needle in msg, msg


def test_per_head_spec_needs_heads_and_ranges_fit(tmp_path):
    spec = parse_mask(_yaml(tmp_path, "mask: {dense: {}}\nheads:\n  2-5: {causal: {}}\n"))
    with pytest.raises(MaskSpecError, match="number of heads is needed"):
        encode(spec, 64)
    with pytest.raises(MaskSpecError, match="'2-5' is out of range for 4 heads"):
        encode(spec, 64, num_heads=4)


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"tile": 48}, "tile size 48"), ({"tile": 8}, "tile size 8"),
])
def test_bad_geometry(kwargs, needle):
    with pytest.raises(MaskSpecError, match=needle):
        encode(parse_mask("causal"), 64, **kwargs)
    with pytest.raises(MaskSpecError, match="sequence length 0"):
        encode(parse_mask("causal"), 0)


def test_yaml_list_items_may_use_the_command_line_form(tmp_path):
    np.save(tmp_path / "lay.npy", np.eye(8, dtype=bool))
    path = _yaml(tmp_path, 'mask:\n  union:\n    - "sliding:window=2,causal=true"\n'
                           '    - "blocksparse:block=16,layout=lay.npy"\n')  # relative to file
    fmt = encode(parse_mask(path), 128, tile=32)
    q, k = np.arange(128)[:, None], np.arange(128)[None, :]
    want = ((q - k >= 0) & (q - k <= 2)) | (q // 16 == k // 16)
    assert (to_dense(fmt) == want).all()
    assert stats(fmt).nnz == int(want.sum())


_NAMES = ["dense", "causal", "sliding", "global", "longformer", "bigbird", "strided", "dilated",
          "blocksparse", "bitmap", "union", "window", "tokens", "first", "block", "stride"]


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.text(max_size=40),
    st.builds(lambda n, items: n + ":" + ",".join(items), st.sampled_from(_NAMES),
              st.lists(st.builds(lambda k, v: f"{k}={v}", st.sampled_from([*_NAMES, "causal"]),
                                 st.text("0123456789-[],.;xtrue ", max_size=8)), max_size=4))))
def test_any_command_line_text_parses_or_fails_in_one_line(text):
    try:
        spec = parse_mask(text)
    except MaskSpecError as err:
        assert "\n" not in str(err) and str(err)
    else:
        assert spec.canonical() and len(spec.hash) == 64


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(
    st.text(max_size=60),
    st.builds(lambda parts: "\n".join(parts), st.lists(st.one_of(
        st.sampled_from(["mask:", "  union:", "    - sliding: {window: 3}", "  causal: true",
                         "heads:", "  0-1: {dense: {}}", "layers:", "  2: causal",
                         "    - global: {tokens: [1, 2]}", "  sliding:", "    window: 4",
                         "  bigbird: {block: 4, window: 3, global: 1, random: 1}", "- x",
                         "  intersect: [", "mask: {dense: null}", "  ? a", "&x", "*x"]),
        st.text(":-[]{} abc0123\t", max_size=10)), max_size=8))))
def test_any_yaml_text_parses_or_fails_in_one_line(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "spec.yaml"
    path.write_text(text)
    try:
        spec = parse_mask(str(path))
    except MaskSpecError as err:
        assert "\n" not in str(err) and str(path) in str(err)
    else:
        assert spec.canonical()
