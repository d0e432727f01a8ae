"""``stofc mask show / stats / export / encode`` through click's CliRunner."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from stofc.cli import main
from stofc.masks import load, to_dense
from tests.unit.test_mask_reference import tree_dense


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_export_matches_reference(tmp_path):
    out = tmp_path / "m.npy"
    res = run("mask", "export", "sliding:window=7,causal=true", "--seq-len", "100", "-o", str(out))
    assert res.exit_code == 0, res.output
    dense = np.load(out)
    assert dense.dtype == bool and dense.shape == (100, 100)
    assert (dense == tree_dense("sliding:window=7,causal=true", 100)).all()


def test_export_per_head(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("mask: {causal: {}}\nheads:\n  1: {sliding: {window: 2}}\n")
    out = tmp_path / "m.npy"
    res = run("mask", "export", str(spec), "-L", "50", "--num-heads", "3", "-o", str(out))
    assert res.exit_code == 0, res.output
    dense = np.load(out)
    assert dense.shape == (3, 50, 50)
    assert (dense[0] == tree_dense("causal", 50)).all() and (dense[2] == dense[0]).all()
    assert (dense[1] == tree_dense("sliding:window=2", 50)).all()


def test_stats_json_and_text():
    res = run("mask", "stats", "longformer:window=64,global=2", "-L", "1000", "--tile", "32",
              "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    dense = tree_dense("longformer:window=64,global=2", 1000)
    assert data["nnz"] == int(dense.sum()) and data["density"] == pytest.approx(dense.mean())
    assert data["tiles_full"] + data["tiles_part"] + data["tiles_empty"] == 32 * 32
    assert data["bitmap_bytes"] == data["tiles_part"] * 16 * 8
    assert data["format_bytes"] > data["bitmap_bytes"]
    assert data["spec"] == {"mask": {"longformer": {"global": 2, "window": 64}}}
    sel = data["selector"]
    assert sel is None or sel["kernel"] in ("block", "row")
    res = run("mask", "stats", "longformer:window=64,global=2", "-L", "1000", "--tile", "32")
    assert res.exit_code == 0
    for key in ("density", "tiles full", "tiles part", "tiles empty", "bitmap bytes",
                "format bytes", "kernel"):
        assert key in res.output


def test_show_element_and_tile_pictures(tmp_path):
    small, large = tmp_path / "s.png", tmp_path / "l.png"
    res = run("mask", "show", "bigbird:block=16,window=3,global=1,random=2", "-L", "200",
              "-o", str(small))
    assert res.exit_code == 0 and "elements" in res.output
    res = run("mask", "show", "sliding:window=300", "-L", "4096", "-o", str(large))
    assert res.exit_code == 0 and "tile map" in res.output
    for path in (small, large):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_encode_writes_a_loadable_format(tmp_path):
    out = tmp_path / "f.npz"
    res = run("mask", "encode", "strided:stride=10", "-L", "130", "--tile", "16", "-o", str(out))
    assert res.exit_code == 0, res.output
    assert (to_dense(load(out)) == tree_dense("strided:stride=10", 130)).all()


@pytest.mark.parametrize("args", [
    ["stats", "slidng:window=3", "-L", "64"],
    ["stats", "sliding:windw=3", "-L", "64"],
    ["stats", "sliding:window=-2", "-L", "64"],
    ["stats", "bigbird:block=8,window=2,global=0,random=0", "-L", "64"],
    ["stats", "causal", "-L", "64", "--tile", "48"],
    ["stats", "causal", "-L", "0"],
    ["stats", "causal", "-L", "64", "--gpu", "v100"],
    ["stats", "causal", "-L", "64", "--batch", "0"],
    ["stats", "causal", "-L", "64", "--layer", "-1"],
    ["stats", "missing.yaml", "-L", "64"],
    ["stats", "BAD_YAML", "-L", "64"],
    ["stats", "PER_HEAD_YAML", "-L", "64"],
    ["stats", "PER_HEAD_YAML", "-L", "64", "--num-heads", "0"],
    ["stats", "PER_HEAD_YAML", "-L", "64", "--num-heads", "2"],
    ["stats", "blocksparse:block=8,layout=FLOAT_NPY", "-L", "64"],
    ["export", "causal", "-L", "20000", "-o", "OUT/x.npy"],
    ["export", "causal", "-L", "64", "-o", "OUT/x.txt"],
    ["show", "causal", "-L", "64", "-o", "OUT/x.gif"],
    ["show", "PER_HEAD_YAML", "-L", "64", "--num-heads", "4", "--head", "4", "-o", "OUT/x.png"],
    ["encode", "causal", "-L", "64", "-o", "OUT/x.npy"],
])
def test_bad_input_is_one_line_exit_2(tmp_path, args):
    (tmp_path / "bad.yaml").write_text("mask:\n  sliding: [window: 3\n")
    (tmp_path / "heads.yaml").write_text("mask: {causal: {}}\nheads:\n  2-3: {dense: {}}\n")
    np.save(tmp_path / "f.npy", np.ones((8, 8), dtype=np.float64))
    subst = {"BAD_YAML": str(tmp_path / "bad.yaml"), "PER_HEAD_YAML": str(tmp_path / "heads.yaml"),
             "FLOAT_NPY": str(tmp_path / "f.npy"), "OUT": str(tmp_path / "out")}
    argv = ["mask"]
    for a in args:
        for key, value in subst.items():
            a = a.replace(key, value)
        argv.append(a)
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
