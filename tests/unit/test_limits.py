"""Issue 16: every size is bounded (documented limits, checked before memory is spent) and
hostile YAML is refused while it is parsed, naming the limit that was hit."""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from stofc.cli import main
from stofc.errors import LimitError
from stofc.masks import encode, parse_mask
from stofc.masks import limits as limits_mod
from stofc.masks.limits import MAX_SEQ_LEN, MAX_YAML_DEPTH, MAX_YAML_NODES

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from build_model import build_model  # noqa: E402


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in result.output
    assert sum(line.startswith("error: ") for line in lines) == 1, result.output
    return lines[-1]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("cmd", ["stats", "show", "export", "encode"])
def test_mask_commands_refuse_huge_lengths_at_once(cmd, tmp_path):
    """Defect: `mask stats causal --seq-len 10000000` grew to 18.6 GB before it was killed."""
    before, start = _rss_mb(), time.perf_counter()
    args = ["mask", cmd, "causal", "--seq-len", "10000000"]
    if cmd != "stats":
        args += ["-o", str(tmp_path / {"show": "m.png", "export": "m.npy", "encode": "m.npz"}[cmd])]
    line = one_error_line(run(*args))
    assert time.perf_counter() - start < 5 and _rss_mb() - before < 200
    assert "10000000" in line and (str(MAX_SEQ_LEN) in line or "16384" in line)


def test_tile_grid_limit_names_the_fix():
    line = one_error_line(run("mask", "stats", "causal", "-L", "65536", "--tile", "16"))
    assert "4096 tile rows" in line and "larger --tile" in line


def test_encode_memory_is_budgeted_before_it_is_spent(monkeypatch):
    """A mask whose tile bitmaps need more than the budget stops when it reaches it."""
    monkeypatch.setattr(limits_mod, "MAX_MASK_BYTES", 1 << 20)
    with pytest.raises(LimitError, match=r"needs more than 1\.0 MiB .*MAX_MASK_BYTES"):
        encode("strided:stride=3", 8192)
    assert encode("causal", 8192).nnz == 8192 * 8193 // 2   # cheap masks still fit


def test_dense_export_is_estimated_before_encoding(tmp_path):
    line = one_error_line(run("mask", "export", "causal", "-L", "16384", "--num-heads", "8",
                              "-o", str(tmp_path / "m.npy")))
    assert "8 x 16384 x 16384 needs 2.0 GiB" in line
    assert not (tmp_path / "m.npy").exists()


def test_heads_are_bounded():
    line = one_error_line(run("mask", "stats", "causal", "-L", "64", "--num-heads", "100000000"))
    assert "100000000 heads" in line


def test_compile_refuses_a_huge_max_seq_len(tmp_path):
    """Defect: `compile --max-seq-len 1000000` ended in ArrayMemoryError with a traceback."""
    model = tmp_path / "m.onnx"
    onnx.save(build_model(layers=1), str(model))
    line = one_error_line(run("compile", str(model), "--mask", "causal", "--max-seq-len",
                              "1000000", "-o", str(tmp_path / "pkg"), "--quiet"))
    assert "1000000" in line and str(MAX_SEQ_LEN) in line
    assert not (tmp_path / "pkg").exists()


def test_max_seq_len_beyond_the_position_table_is_refused(tmp_path):
    """Defect: --max-seq-len above the model's position table was accepted silently."""
    model = tmp_path / "m.onnx"
    onnx.save(build_model(layers=1, seq=64), str(model))
    line = one_error_line(run("compile", str(model), "--mask", "causal", "--max-seq-len", "128",
                              "-o", str(tmp_path / "pkg"), "--quiet"))
    assert "position table" in line and "64 positions" in line and "--max-seq-len 64" in line
    # the default follows the table when it is shorter than 512
    result = run("compile", str(model), "--mask", "causal", "-o", str(tmp_path / "pkg"))
    assert result.exit_code == 0, result.output
    assert "max_seq_len 64" in result.output
    import json
    assert json.loads((tmp_path / "pkg" / "plan.json").read_text())["plan"]["max_seq_len"] == 64


# ---------------------------------------------------------------- hostile YAML


def _write(tmp_path: Path, text: str, name: str = "m.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_deep_union_is_refused_naming_the_depth_limit(tmp_path):
    """Defect: `union` nested a few hundred deep raised RecursionError with a traceback."""
    deep = _write(tmp_path, "mask:\n  " + "{union: [" * 400 + "causal" + "]}" * 400 + "\n")
    line = one_error_line(run("mask", "stats", str(deep), "-L", "64"))
    assert f"deeper than {MAX_YAML_DEPTH} levels" in line and "MAX_YAML_DEPTH" in line
    ok = _write(tmp_path, "mask:\n  " + "{union: [" * 20 + "causal" + "]}" * 20 + "\n", "ok.yaml")
    assert run("mask", "stats", str(ok), "-L", "64").exit_code == 0


def test_alias_bomb_is_refused_quickly(tmp_path):
    """Defect: a 687-byte alias bomb ran for more than 120 s and took 1.6 GB."""
    text = "a0: &a0 {causal: {}}\n" + "".join(
        f"a{i}: &a{i} {{union: [*a{i - 1}, *a{i - 1}, *a{i - 1}]}}\n" for i in range(1, 12))
    bomb = _write(tmp_path, text + "mask: *a11\n")   # 3**11 masks once expanded
    assert bomb.stat().st_size < 1000
    before, start = _rss_mb(), time.perf_counter()
    line = one_error_line(run("mask", "stats", str(bomb), "-L", "64"))
    assert time.perf_counter() - start < 5 and _rss_mb() - before < 100
    assert f"more than {MAX_YAML_NODES} nodes" in line and "aliases" in line


def test_recursive_alias_and_big_file_and_binary(tmp_path):
    line = one_error_line(run("mask", "stats", str(_write(tmp_path, "mask: &a {union: [*a]}\n")),
                              "-L", "64"))
    assert "refers to the collection that contains it" in line
    big = _write(tmp_path, "# " + "x" * (2 << 20) + "\nmask: causal\n", "big.yaml")
    assert "MAX_YAML_BYTES" in one_error_line(run("mask", "stats", str(big), "-L", "64"))
    raw = tmp_path / "bin.yaml"
    raw.write_bytes(b"mask: \xff\xfe causal\n")
    assert "UTF-8" in one_error_line(run("mask", "stats", str(raw), "-L", "64"))


def test_many_families_are_refused(tmp_path):
    items = ", ".join(["{sliding: {window: 3}}"] * 300)
    line = one_error_line(run("mask", "stats", str(_write(tmp_path, f"mask: {{union: [{items}]}}\n")),
                              "-L", "64"))
    assert "MAX_MASK_NODES" in line


def test_a_huge_npy_is_refused_from_its_header(tmp_path):
    import numpy as np

    path = tmp_path / "big.npy"
    header = np.lib.format
    with open(path, "wb") as f:   # a header claiming 200000 x 200000 bools, no data
        header.write_array_header_2_0(f, {"descr": "|b1", "fortran_order": False,
                                          "shape": (200000, 200000)})
    with pytest.raises(LimitError, match="above stofc's limits"):
        parse_mask(f"bitmap:file={path}")
