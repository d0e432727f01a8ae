"""The custom-op library build: ORT headers, the cached g++ build, mask.bin round trip."""

from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest

from stofc.errors import StofcError
from stofc.masks.format import MaskFormat
from stofc.package import ort_headers, ortlib
from stofc.package.maskbin import encode_mask_binary, read_mask_binary, write_mask_binary


@pytest.fixture(scope="module")
def headers():
    return ort_headers.find_ort_headers()


def test_headers_are_api_21_or_newer(headers):
    assert headers.api_version >= 21
    assert (headers.include_dir / "onnxruntime_cxx_api.h").is_file()


def test_explicit_include_and_environment_override(headers, tmp_path, monkeypatch):
    got = ort_headers.find_ort_headers(headers.include_dir.parent)  # accepts DIR/onnxruntime
    assert got.include_dir == headers.include_dir and got.source == "explicit"
    monkeypatch.setenv("STOFC_ORT_INCLUDE", str(headers.include_dir))
    got = ort_headers.find_ort_headers()
    assert got.source == "environment" and got.api_version == headers.api_version
    with pytest.raises(StofcError, match="no ONNX Runtime headers"):
        ort_headers.find_ort_headers(tmp_path)


def test_old_headers_are_refused(headers, tmp_path):
    for name in ort_headers.REQUIRED:
        text = (headers.include_dir / name).read_text()
        if name == "onnxruntime_c_api.h":
            text = text.replace(f"#define ORT_API_VERSION {headers.api_version}",
                                "#define ORT_API_VERSION 20")
        (tmp_path / name).write_text(text)
    with pytest.raises(StofcError, match="API 20"):
        ort_headers.find_ort_headers(tmp_path)


def test_debian_archive_comes_from_apt_configuration():
    uris = ort_headers.debian_archive_uris()
    assert uris, "this image's apt sources name a Debian archive"
    assert all(u.endswith("/") and "://" in u for u in uris)


def test_fetch_through_apt(tmp_path, monkeypatch):
    """The fresh-machine path: libonnxruntime-dev through apt, unpacked into the cache."""
    monkeypatch.delenv("STOFC_ORT_INCLUDE", raising=False)
    monkeypatch.setenv("STOFC_CACHE_DIR", str(tmp_path / "cache"))
    if ort_headers._locate(ort_headers.SYSTEM_DIR):
        pytest.skip("a system libonnxruntime-dev is installed; apt is not consulted")
    with pytest.raises(StofcError, match="no ONNX Runtime headers found"):
        ort_headers.find_ort_headers(fetch=False)
    got = ort_headers.find_ort_headers()
    assert got.source == "apt" and got.api_version == 21
    assert got.include_dir.is_relative_to(tmp_path / "cache" / "ort-headers")
    assert ort_headers.find_ort_headers().source == "cache"


def test_build_exports_only_register_custom_ops(tmp_path):
    lib = ortlib.build_library(tmp_path)
    assert lib == tmp_path / ortlib.LIBRARY_NAME and lib.is_file()
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                         check=True).stdout
    assert [line.split()[-1] for line in out.splitlines() if line.strip()] == ["RegisterCustomOps"]
    deps = subprocess.run(["ldd", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "onnxruntime" not in deps and "libcuda" not in deps and "libstdc++" not in deps
    ctypes.CDLL(str(lib)).RegisterCustomOps  # noqa: B018 - loads and resolves


def test_key_prep_kernel_is_embedded(tmp_path):
    """The CUDA twin's key-prep kernel compiles with NVRTC and lands in the library as PTX."""
    ptx = ortlib.key_prep_ptx()
    assert b".entry stofc_key_prep" in ptx and b".target sm_80" in ptx
    lib = ortlib.build_library(tmp_path)
    assert ptx in lib.read_bytes()


def test_build_is_cached_by_key(tmp_path, headers):
    a = ortlib.build_library(tmp_path / "a")
    b = ortlib.build_library(tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()
    k1 = ortlib.library_key(headers, "g++ (X) 1.0")
    assert k1 == ortlib.library_key(headers, "g++ (X) 1.0")
    assert k1 != ortlib.library_key(headers, "g++ (X) 2.0")
    assert k1 != ortlib.library_key(headers, "g++ (X) 1.0", b"other ptx")


def test_missing_compiler_is_a_clear_error(tmp_path):
    with pytest.raises(StofcError, match="compiler 'no-such-c\\+\\+' not found"):
        ortlib.build_library(tmp_path, compiler="no-such-c++")


def _format() -> MaskFormat:
    i32 = np.int32
    return MaskFormat(
        spec='{"causal": true}', spec_hash="ab" * 32, seq_len=20, tile=16, num_heads=1,
        full_row_ptr=np.array([[0, 0, 1]], i32), full_col_idx=np.array([0], i32),
        part_row_ptr=np.array([[0, 1, 2]], i32), part_col_idx=np.array([0, 1], i32),
        part_bitmaps=np.arange(8, dtype=np.uint64).reshape(2, 4) * np.uint64(0x0101),
        load_row_ptr=np.array([[0, 1, 3]], i32), load_col_idx=np.array([0, 0, 1], i32),
        load_part_idx=np.array([0, -1, 1], i32), row_nnz=np.array([[136, 26]], np.int64), nnz=162)


def test_mask_binary_round_trip(tmp_path):
    fmt = _format()
    path = write_mask_binary(fmt, tmp_path / "m" / "mask.bin")
    data = path.read_bytes()
    assert data[:8] == b"STOFMASK" and len(data) % 8 == 0
    back = read_mask_binary(path)
    assert (back.seq_len, back.tile, back.num_heads, back.nnz, back.spec_hash) == (
        20, 16, 1, 162, "ab" * 32)
    for name in ("full_row_ptr", "full_col_idx", "part_row_ptr", "part_col_idx", "part_bitmaps",
                 "load_row_ptr", "load_col_idx", "load_part_idx", "row_nnz"):
        np.testing.assert_array_equal(getattr(back, name), getattr(fmt, name), err_msg=name)
    assert encode_mask_binary(back) == data


def test_mask_binary_rejects_inconsistent_format():
    fmt = _format()
    bad = MaskFormat(**{**fmt.__dict__, "load_part_idx": np.array([0, -1], np.int32)})
    with pytest.raises(StofcError, match="load_part_idx"):
        encode_mask_binary(bad)


def test_cli_builds_the_library(tmp_path, headers):
    from click.testing import CliRunner

    from stofc.cli import main

    res = CliRunner().invoke(main, ["ortlib", "-o", str(tmp_path / "out"),
                                    "--ort-include", str(headers.include_dir)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "out" / ortlib.LIBRARY_NAME).is_file()
    assert f"API {headers.api_version}" in res.output
    res = CliRunner().invoke(main, ["ortlib", "-o", str(tmp_path), "--ort-include", str(tmp_path)])
    assert res.exit_code == 2 and "error: no ONNX Runtime headers" in res.output


def test_fetch_checks_the_pinned_hash(tmp_path, monkeypatch):
    if ort_headers._apt_candidate():
        pytest.skip("apt's own suites carry libonnxruntime-dev here; apt verifies it")
    monkeypatch.setattr(ort_headers, "PINNED_SHA256", "0" * 64)
    with pytest.raises(StofcError, match=r"cannot fetch libonnxruntime-dev through apt.*Hash Sum mismatch"):
        ort_headers._fetch_with_apt(tmp_path)
    assert not list(tmp_path.glob("libonnxruntime-dev_*"))  # nothing half-written
