"""``stofc compile``'s check (issue 15 item 6, issue 16): a package that does not run, or that
computes something other than the model, is never written."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

import stofc
from stofc.cli import main
from stofc.errors import CheckError
from stofc.package import writer
from stofc.package.selfcheck import CHECK_LEN, check_len
from stofc.pipeline import Instruments, compile_model, recompile_package

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from build_model import build_model  # noqa: E402

MASK = "sliding:window=16"


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model.onnx"
    onnx.save(build_model(layers=2), str(path))
    return path


def _break_second_norm(model: onnx.ModelProto) -> None:
    """A wrong epsilon in layer 1's attention AddLayerNorm: runs, computes something else."""
    norms = [n for n in model.graph.node if n.op_type == "AddLayerNorm"]
    for attr in norms[2].attribute:
        if attr.name == "epsilon":
            attr.f = 0.5


def _break_heads(model: onnx.ModelProto) -> None:
    """A SparseAttention whose head count does not divide its input: ORT fails at run."""
    node = next(n for n in model.graph.node if n.op_type == "SparseAttention")
    for attr in node.attribute:
        if attr.name == "num_heads":
            attr.i = 3


def _saving(monkeypatch, damage) -> None:
    real = writer._save_model

    def save(model, root):
        damage(model)
        real(model, root)

    monkeypatch.setattr(writer, "_save_model", save)


def test_check_runs_and_is_quick(example, tmp_path):
    ins = Instruments(progress=False)
    pkg = compile_model(example, MASK, max_seq_len=128, out_dir=tmp_path / "pkg",
                        instruments=ins)
    stofc.load(pkg, providers=["CPUExecutionProvider"])
    assert check_len(128) == CHECK_LEN and check_len(40) == 40
    assert [name for name, _ in ins.timings].count("write package") == 1  # the check is inside


def test_a_package_that_computes_something_else_is_not_written(example, tmp_path, monkeypatch):
    _saving(monkeypatch, _break_second_norm)
    out = tmp_path / "pkg"
    with pytest.raises(CheckError) as info:
        compile_model(example, MASK, max_seq_len=128, out_dir=out,
                      instruments=Instruments(progress=False))
    text = str(info.value)
    assert "\n" not in text and "does not compute the model" in text
    assert "first goes wrong at layer 1" in text and "AddLayerNorm" in text
    assert list(tmp_path.iterdir()) == []   # no package, no temporary directory


def test_a_package_that_fails_in_ort_names_the_node_and_keeps_the_old_one(example, tmp_path,
                                                                          monkeypatch):
    out = compile_model(example, MASK, max_seq_len=128, out_dir=tmp_path / "pkg",
                        instruments=Instruments(progress=False))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    _saving(monkeypatch, _break_heads)
    result = CliRunner().invoke(main, ["compile", str(example), "--mask", "causal",
                                       "--max-seq-len", "128", "-o", str(out), "--quiet"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "Traceback" not in result.output
    assert "SparseAttention" in lines[-1] and "--no-check" in lines[-1]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]


def test_no_check_writes_it_anyway(example, tmp_path, monkeypatch):
    _saving(monkeypatch, _break_second_norm)
    result = CliRunner().invoke(main, ["compile", str(example), "--mask", MASK, "--max-seq-len",
                                       "128", "-o", str(tmp_path / "pkg"), "--quiet",
                                       "--no-check"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "pkg")])
    assert result.exit_code == 1 and "verify failed" in result.output  # what the check caught


def test_tune_rewrite_is_checked_before_it_replaces_the_package(example, tmp_path, monkeypatch):
    from stofc.package.load import read_plan

    pkg = compile_model(example, MASK, max_seq_len=128, out_dir=tmp_path / "pkg",
                        instruments=Instruments(progress=False))
    before = {p: p.read_bytes() for p in pkg.rglob("*") if p.is_file()}
    _saving(monkeypatch, _break_second_norm)
    with pytest.raises(CheckError, match="does not compute the model"):
        recompile_package(pkg, read_plan(pkg), instruments=Instruments(progress=False))
    assert {p: p.read_bytes() for p in pkg.rglob("*") if p.is_file()} == before


def test_check_time_on_the_example(tmp_path, capsys):
    """The check on the bundled example takes well under a second (bench/compile_check_time.py
    measures BERT-base shapes too)."""
    model = tmp_path / "m.onnx"
    onnx.save(build_model(), str(model))
    ins = Instruments(progress=False)
    start = time.perf_counter()
    compile_model(model, "bigbird:block=16,window=3,global=1,random=1,seed=0", max_seq_len=128,
                  out_dir=tmp_path / "pkg", instruments=ins)
    total = time.perf_counter() - start
    check = ins.nested["check package (CPU EP)"]
    with capsys.disabled():
        print(f"\n[check time] example: check {check:.2f} s of compile {total:.2f} s "
              f"(B=2, L={check_len(128)})")
    assert check < 10
    assert json.loads((tmp_path / "pkg" / "plan.json").read_text())["plan"]["max_seq_len"] == 128
