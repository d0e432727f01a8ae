"""Malformed packages, nodes and inputs give a clear ONNX Runtime error, never a crash."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from stofc.package.maskbin import write_mask_binary
from stofc.package.ortlib import build_library
from tests.unit.test_ortlib import F32, dense_to_format, run_node, vi

L = 32


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_library(tmp_path_factory.mktemp("lib"))


@pytest.fixture
def pkg(tmp_path):
    write_mask_binary(dense_to_format(np.tril(np.ones((1, L, L), bool)), 16), tmp_path / "m.bin")
    return tmp_path


def attention(lib, pkg, *, q_shape=(1, 16, 16), k_shape=None, kpm=None, bias=None, keep=None,
              **attrs):
    rng = np.random.default_rng(0)
    q = rng.standard_normal(q_shape).astype(np.float32)
    k = rng.standard_normal(k_shape or q_shape).astype(np.float32)
    names, inputs = ["q", "k", "k"], [vi("q", F32, None), vi("k", F32, None)]
    feeds = {"q": q, "k": k}
    for name, value, elem in (("kpm", kpm, None), ("bias", bias, F32)):
        if value is None:
            names.append("")
            continue
        names.append(name)
        inputs.append(vi(name, elem or helper.np_dtype_to_tensor_dtype(value.dtype), None))
        feeds[name] = value
    while names[-1] == "":
        names.pop()
    node = helper.make_node("SparseAttention", names, ["out0"], domain="ai.stofc",
                            **{"num_heads": 2, "head_dim": 8, "mask_file": "m.bin", **attrs})
    return run_node(lib, node, inputs, feeds, package_dir=pkg, keep=keep)


def test_missing_mask_file(lib, pkg):
    with pytest.raises(Exception, match=r"stofc SparseAttention: mask file '.*nope\.bin' cannot be opened"):
        attention(lib, pkg, mask_file="nope.bin")


@pytest.mark.parametrize("damage", ["truncate", "magic", "version", "col_idx"])
def test_corrupt_mask_file(lib, pkg, damage):
    data = bytearray((pkg / "m.bin").read_bytes())
    if damage == "truncate":
        data = data[:-8]
    elif damage == "magic":
        data[:8] = b"NOTAMASK"
    elif damage == "version":
        data[8] = 9
    else:  # full_col_idx follows full_row_ptr [1, R+1] int32 (R = 2, 12 bytes, padded to 16)
        n_full = int.from_bytes(data[32:40], "little")
        assert n_full > 0
        data[128 + 16:128 + 20] = (7).to_bytes(4, "little")
    (pkg / "m.bin").write_bytes(bytes(data))
    expected = {"truncate": "size does not match", "magic": "bad magic",
                "version": "layout version 9", "col_idx": "col_idx out of range"}[damage]
    with pytest.raises(Exception, match=f"mask file .* {expected}"):
        attention(lib, pkg)


def test_missing_attribute(lib, pkg):
    node = helper.make_node("SparseAttention", ["q", "q", "q"], ["out0"], domain="ai.stofc",
                            head_dim=8, mask_file="m.bin")
    q = np.zeros((1, 4, 16), np.float32)
    with pytest.raises(Exception, match="missing required attribute 'num_heads'"):
        run_node(lib, node, [vi("q", F32, None)], {"q": q}, package_dir=pkg)


def test_per_head_mask_with_other_head_count(lib, pkg):
    write_mask_binary(dense_to_format(np.ones((3, L, L), bool), 16), pkg / "m.bin")
    with pytest.raises(Exception, match="3 per-head masks but the node has num_heads=2"):
        attention(lib, pkg)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(q_shape=(1, 16, 12)), r"input q has shape \[1, 16, 12\], expected \[B, S, 16\]"),
    (dict(q_shape=(16, 16)), r"input q has shape \[16, 16\]"),
    (dict(k_shape=(1, 15, 16)), r"input k has shape \[1, 15, 16\], expected \[1, 16, 16\]"),
    (dict(q_shape=(1, 40, 16)), r"sequence length 40 exceeds the compiled maximum 32"),
    (dict(kpm=np.ones((1, 15), np.int64)), r"key_padding_mask has shape \[1, 15\]"),
    (dict(kpm=np.ones((1, 16), np.float32)), r"key_padding_mask must be int64, int32 or bool"),
    (dict(bias=np.zeros((1, 2, 16, 15), np.float32)), r"bias has shape \[1, 2, 16, 15\]"),
])
def test_bad_attention_inputs(lib, pkg, kwargs, message):
    with pytest.raises(Exception, match=message):
        attention(lib, pkg, **kwargs)


def test_bad_gemm_node_and_inputs(lib):
    x, w = np.zeros((3, 8), np.float32), np.zeros((7, 4), np.float32)
    inputs = [vi("x", F32, None), vi("w", F32, None)]
    node = helper.make_node("FusedGemm", ["x", "w"], ["out0"], domain="ai.stofc")
    with pytest.raises(Exception, match=r"input w has shape \[7, 4\], expected \[K, N\] with K=8"):
        run_node(lib, node, inputs, {"x": x, "w": w})
    node = helper.make_node("FusedGemm", ["x", "w"], ["out0"], domain="ai.stofc", activation="relu6")
    with pytest.raises(Exception, match="activation='relu6' is not one of none, gelu_erf, gelu_tanh"):
        run_node(lib, node, inputs, {"x": x, "w": np.zeros((8, 4), np.float32)})


def test_bad_norm_inputs(lib):
    x, g = np.zeros((3, 8), np.float32), np.zeros(6, np.float32)
    node = helper.make_node("AddLayerNorm", ["x", "", "g"], ["out0"], domain="ai.stofc")
    with pytest.raises(Exception, match=r"input gamma has shape \[6\], expected \[8\]"):
        run_node(lib, node, [vi("x", F32, None), vi("g", F32, None)], {"x": x, "g": g})
    node = helper.make_node("AddLayerNorm", ["x", "", "g"], ["out0"], domain="ai.stofc", rms=2)
    with pytest.raises(Exception, match="attribute rms must be 0 or 1"):
        run_node(lib, node, [vi("x", F32, None), vi("g", F32, None)],
                 {"x": x, "g": np.zeros(8, np.float32)})


def test_int32_inputs_have_no_kernel(lib):
    """Types outside float/float16 are rejected by ORT's type check, not by a crash."""
    x = np.zeros((3, 8), np.int32)
    node = helper.make_node("FusedGemm", ["x", "x"], ["out0"], domain="ai.stofc")
    with pytest.raises(Exception):  # noqa: B017 - ORT's own message varies across versions
        run_node(lib, node, [vi("x", TensorProto.INT32, None)], {"x": x})


def test_rewritten_mask_is_read_afresh(lib, pkg):
    """A mask file replaced in place is not served from the per-process cache."""
    alive: list = []
    attention(lib, pkg, keep=alive)  # reads the good file; its session keeps the mask cached
    (pkg / "m.bin").write_bytes(b"NOTAMASK" + bytes(200))
    with pytest.raises(Exception, match="bad magic"):
        attention(lib, pkg)


# ------------------------------------------------- package-relative paths stay in the package


def _outside_mask(pkg):
    """A valid mask file outside the package directory (so only confinement can refuse it)."""
    outside = pkg.parent / f"{pkg.name}-outside"
    outside.mkdir(exist_ok=True)
    (outside / "m.bin").write_bytes((pkg / "m.bin").read_bytes())
    return outside / "m.bin"


@pytest.mark.parametrize("how", ["dotdot", "absolute", "inner_dotdot", "symlink_out",
                                 "dev_zero", "directory"])
def test_mask_file_is_confined_to_the_package(lib, pkg, how):
    """issue 16: mask_file may not name a file outside the package, an absolute path, or a
    device; each is refused at session creation with the reason (before this, the library
    opened '../..', absolute paths and /dev/zero)."""
    outside = _outside_mask(pkg)
    rel = f"../{outside.parent.name}/m.bin"
    message = {"dotdot": "leaves the package directory", "absolute": "is an absolute path",
               "inner_dotdot": "leaves the package directory",
               "symlink_out": "outside the package directory",
               "dev_zero": "outside the package directory", "directory": "not a regular file"}[how]
    if how == "absolute":
        rel = str(outside)
    elif how == "inner_dotdot":
        (pkg / "sub").mkdir()
        rel = "sub/../m.bin"  # inside, but '..' is refused outright: no path games
    elif how == "symlink_out":
        (pkg / "link.bin").symlink_to(outside)
        rel = "link.bin"
    elif how == "dev_zero":
        (pkg / "zero.bin").symlink_to("/dev/zero")
        rel = "zero.bin"
    elif how == "directory":
        (pkg / "adir.bin").mkdir()
        rel = "adir.bin"
    with pytest.raises(Exception, match=message):
        attention(lib, pkg, mask_file=rel)


def test_symlink_inside_the_package_is_fine(lib, pkg):
    (pkg / "masks").mkdir()
    (pkg / "masks" / "real.bin").write_bytes((pkg / "m.bin").read_bytes())
    (pkg / "alias.bin").symlink_to(pkg / "masks" / "real.bin")
    (out,) = attention(lib, pkg, mask_file="alias.bin")
    assert np.isfinite(out).all()
