"""Issue 16, "smaller defects": each test names the defect; before the fix each was a
traceback, a silent acceptance or a dead path in an error message."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

import stofc
from stofc.cli import main
from stofc.errors import PackageError
from stofc.package.load import check_package
from stofc.package.manifest import build_manifest, read_manifest, write_manifest
from stofc.pipeline import Instruments, compile_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from build_model import build_model  # noqa: E402

MASK = "sliding:window=16"


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model.onnx"
    onnx.save(build_model(layers=2), str(path))
    return path


@pytest.fixture(scope="module")
def built(example, tmp_path_factory) -> Path:
    return compile_model(example, MASK, max_seq_len=64,
                         out_dir=tmp_path_factory.mktemp("pkg") / "pkg",
                         instruments=Instruments(progress=False))


@pytest.fixture
def package(built, tmp_path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "copy"))


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in result.output
    assert sum(line.startswith("error: ") for line in lines) == 1, result.output
    return lines[-1]


def _resign(package: Path) -> None:
    """Recompute the manifest after an edit (a hostile or buggy package that checks out)."""
    m = read_manifest(package)
    write_manifest(package, build_manifest(package, stofc=m.stofc, gpu=m.gpu, arch=m.arch,
                                           ptx=m.ptx, dtype=m.dtype))


@pytest.mark.parametrize("value", ["sixty-four", None, -3])
def test_verify_checks_the_manifest_before_parsing_plan_json(package, value):
    """Defect: an edited value in plan.json gave a ValueError/KeyError traceback in verify."""
    doc = json.loads((package / "plan.json").read_text())
    doc["plan"]["max_seq_len"] = value
    (package / "plan.json").write_text(json.dumps(doc))
    line = one_error_line(run("verify", str(package)))
    assert "plan.json" in line and "modified" in line
    _resign(package)   # even with a manifest that matches, it is one line, not a crash
    line = one_error_line(run("verify", str(package)))
    assert "plan.json is malformed" in line and "max_seq_len" in line


def test_yaml_layer_overrides_past_the_last_layer_are_an_error(example, tmp_path):
    """Defect: YAML `layers:` naming layers the model lacks were silently ignored."""
    spec = tmp_path / "m.yaml"
    spec.write_text('mask: {causal: {}}\nlayers:\n  "1-5": {sliding: {window: 8}}\n')
    line = one_error_line(run("compile", str(example), "--mask", str(spec), "--max-seq-len",
                              "64", "-o", str(tmp_path / "pkg"), "--quiet"))
    assert "layer override '1-5' is out of range" in line and "2 attention layers" in line
    assert "0-1" in line
    spec.write_text('mask: {causal: {}}\nlayers:\n  "1": {sliding: {window: 8}}\n')
    result = run("compile", str(example), "--mask", str(spec), "--max-seq-len", "64", "-o",
                 str(tmp_path / "pkg"), "--quiet")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("arch", ["garbage", "sm_", "sm_9x", ""])
def test_a_garbage_arch_string_is_one_line(package, arch):
    """Defect: a garbage arch string in a package gave an IndexError traceback."""
    data = json.loads((package / "manifest.json").read_text())
    data["arch"] = arch
    (package / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(PackageError, match="malformed") as info:
        check_package(package, providers=["CUDAExecutionProvider"], device_cc=lambda: (9, 0))
    assert "\n" not in str(info.value)
    assert "malformed" in one_error_line(run("verify", str(package)))


def test_a_manifest_naming_files_outside_the_package_is_refused(package):
    data = json.loads((package / "manifest.json").read_text())
    data["files"]["../../etc/passwd"] = {"sha256": "0" * 64, "bytes": 1}
    (package / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(PackageError, match="not a path inside the package"):
        stofc.load(package, providers=["CPUExecutionProvider"])


def test_cxx_failures_give_a_hint_and_no_dead_path(tmp_path):
    """Defect: --cxx and g++ failures gave no hint and named a deleted temporary path."""
    line = one_error_line(run("ortlib", "-o", str(tmp_path), "--cxx", "no-such-compiler-xyz"))
    assert "'no-such-compiler-xyz' not found" in line and "--cxx" in line
    line = one_error_line(run("ortlib", "-o", str(tmp_path), "--cxx", str(tmp_path)))
    assert "not found" in line or "cannot be run" in line
    line = one_error_line(run("ortlib", "-o", str(tmp_path / "lib"), "--cxx", "false"))
    assert line.startswith("error: false failed") and "--cxx" in line and "C++17" in line
    assert ".build-" not in line
    assert "(source: " in line
    source = line.split("(source: ", 1)[1].split(")", 1)[0]
    assert Path(source).is_file() and Path(source).parent == ROOT / "cuda" / "ort"


@pytest.mark.parametrize("args,text", [
    (["compile"], "error: missing argument 'MODEL'; see 'stofc compile --help'"),
    (["mask", "stats", "causal"],
     "error: missing option '--seq-len' / '-L'; see 'stofc mask stats --help'"),
    (["mask", "stats", "causal", "-L", "x"],
     "error: invalid value for '--seq-len' / '-L': 'x' is not a valid integer; "
     "see 'stofc mask stats --help'"),
    (["--frobnicate"], "error: no such option '--frobnicate'; see 'stofc --help'"),
    (["frobnicate"], "error: no such command 'frobnicate'; see 'stofc --help'"),
])
def test_click_errors_read_like_stofc_errors(args, text):
    """Defect: click's own `Error:` lines (after a usage block) and stofc's `error:` lines
    read as two styles; now both are one `error: <problem>; <fix>` line, exit 2."""
    result = CliRunner().invoke(main, args, prog_name="stofc")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [text]


def test_a_bug_says_so_and_exits_1(monkeypatch, tmp_path):
    """An unexpected exception is a stofc bug: one line that says so, exit 1, traceback saved."""
    import stofc.commands.mask as mask_cmd

    def broken(*args, **kwargs):
        raise ZeroDivisionError("simulated bug")

    monkeypatch.setattr(mask_cmd, "_encode", broken)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = run("mask", "stats", "causal", "-L", "64")
    assert result.exit_code == 1
    (line,) = [x for x in result.output.splitlines() if x.strip()]
    assert line.startswith("error: internal error (ZeroDivisionError: simulated bug)")
    assert "this is a stofc bug" in line
    (crash,) = tmp_path.glob("stofc-crash-*.txt")
    assert "ZeroDivisionError" in crash.read_text() and "Traceback" in crash.read_text()
