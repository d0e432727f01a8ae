"""Atomic writes and malformed packages: one clear PackageError line, never a crash."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import onnx
import pytest

import stofc
from stofc.errors import DeviceError, PackageError, StofcError
from stofc.package import load as load_mod
from stofc.package import writer
from stofc.package.manifest import read_manifest
from stofc.pipeline import Instruments, compile_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from build_model import build_model  # noqa: E402

MASK = "sliding:window=16"


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model.onnx"
    onnx.save(build_model(layers=1), str(path))
    return path


@pytest.fixture(scope="module")
def built(example, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pkg") / "pkg"
    return compile_model(example, MASK, max_seq_len=64, out_dir=out,
                         instruments=Instruments(progress=False))


@pytest.fixture
def package(built, tmp_path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    return copy


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text and text
    return text


def test_intact_package_loads(package):
    assert stofc.load(package, providers=["CPUExecutionProvider"]) is not None


def test_missing_cubin(package):
    cubin = next((package / "kernels").glob("*.cubin"))
    cubin.unlink()
    with pytest.raises(PackageError) as info:
        stofc.load(package, providers=["CPUExecutionProvider"])
    assert f"missing kernels/{cubin.name}" in _one_line(info.value)


def test_edited_plan(package):
    doc = json.loads((package / "plan.json").read_text())
    doc["plan"]["dtype"] = "bfloat16"
    (package / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(PackageError) as info:
        stofc.load(package, providers=["CPUExecutionProvider"])
    assert "plan.json" in _one_line(info.value) and "modified" in str(info.value)


def test_edited_model(package):
    with open(package / "model.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(PackageError, match=r"model\.onnx .* modified"):
        stofc.load(package)


def test_missing_manifest_and_directory(package, tmp_path):
    (package / "manifest.json").unlink()
    with pytest.raises(PackageError, match=r"no manifest\.json"):
        stofc.load(package)
    with pytest.raises(PackageError, match="does not exist"):
        stofc.load(tmp_path / "nowhere")


def test_malformed_manifest(package):
    (package / "manifest.json").write_text("{not json")
    with pytest.raises(PackageError) as info:
        stofc.load(package)
    assert "malformed" in _one_line(info.value)


def test_wrong_gpu_arch(package):
    with pytest.raises(PackageError) as info:
        load_mod.check_package(package, providers=["CUDAExecutionProvider"],
                               device_cc=lambda: (8, 0))
    text = _one_line(info.value)
    assert "sm_90" in text and "sm_80" in text and "--gpu" in text
    # same arch, or a later minor revision of it, passes; no GPU is a DeviceError
    load_mod.check_package(package, providers=["CUDAExecutionProvider"], device_cc=lambda: (9, 0))
    with pytest.raises(DeviceError):
        load_mod.check_package(package, providers=[("CUDAExecutionProvider", {})],
                               device_cc=lambda: None)
    # the CPU twins need no kernels: no arch check
    load_mod.check_package(package, providers=["CPUExecutionProvider"], device_cc=lambda: (8, 0))


def test_failure_mid_write_leaves_nothing(example, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise StofcError("simulated failure while building the library")

    monkeypatch.setattr("stofc.package.writer.build_library", broken)
    out = tmp_path / "new.stofc"
    with pytest.raises(StofcError, match="simulated"):
        compile_model(example, MASK, max_seq_len=64, out_dir=out,
                      instruments=Instruments(progress=False))
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary directory left behind


def test_failure_keeps_existing_package(package, example, monkeypatch):
    before = {p: p.read_bytes() for p in package.rglob("*") if p.is_file()}

    def broken(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "write_manifest", broken)
    with pytest.raises(KeyboardInterrupt):
        compile_model(example, "causal", max_seq_len=64, out_dir=package,
                      instruments=Instruments(progress=False))
    after = {p: p.read_bytes() for p in package.rglob("*") if p.is_file()}
    assert after == before
    assert [p.name for p in package.parent.iterdir()] == [package.name]
    stofc.load(package, providers=["CPUExecutionProvider"])


def test_rewrite_in_place_replaces_package(package, example):
    compile_model(example, "causal", max_seq_len=64, out_dir=package,
                  instruments=Instruments(progress=False))
    doc = json.loads((package / "plan.json").read_text())
    assert doc["mask"]["spec"] == "causal"
    stofc.load(package, providers=["CPUExecutionProvider"])
    assert [p.name for p in package.parent.iterdir()] == [package.name]


def test_refuses_foreign_directory(example, tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(PackageError, match="not empty and is not a stofc package"):
        compile_model(example, MASK, max_seq_len=64, out_dir=foreign,
                      instruments=Instruments(progress=False))
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_external_data_in_and_out(tmp_path, monkeypatch):
    """A model with external weights compiles; a large package keeps weights in model.onnx.data."""
    src = tmp_path / "src"
    src.mkdir()
    onnx.save(build_model(layers=1), str(src / "ext.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="ext.onnx.data", size_threshold=0)
    assert (src / "ext.onnx.data").is_file()
    monkeypatch.setattr(writer, "EXTERNAL_DATA_BYTES", 0)  # as if the model were > 1 GiB
    pkg = compile_model(src / "ext.onnx", MASK, max_seq_len=64, out_dir=tmp_path / "pkg",
                        instruments=Instruments(progress=False))
    files = {f for f, _, _ in read_manifest(pkg).files}
    assert {"model.onnx", "model.onnx.data"} <= files
    assert (pkg / "model.onnx").stat().st_size < (pkg / "model.onnx.data").stat().st_size
    from stofc.package.verify import verify_package
    assert verify_package(pkg, cases=[(2, 40)]).passed


def test_library_that_does_not_load_is_one_line(package):
    """A corrupt custom-op library (manifest updated to match) fails as a PackageError."""
    from stofc.package.manifest import build_manifest, write_manifest

    (package / "libstofc_ort.so").write_bytes(b"not an ELF file")
    m = read_manifest(package)
    write_manifest(package, build_manifest(package, stofc=m.stofc, gpu=m.gpu, arch=m.arch,
                                           ptx=m.ptx, dtype=m.dtype))
    with pytest.raises(PackageError) as info:
        stofc.load(package, providers=["CPUExecutionProvider"])
    assert "ONNX Runtime could not load package" in _one_line(info.value)
