"""Session-2 contracts of the custom-op library (cuda/ort/OPS.md), CPU twins in ONNX Runtime.

B. Packed QKV: SparseAttention with both k and v omitted reads q as
   ``[B, S, 3*H*D] = [Q | K | V]``; it must give exactly the output of the same node
   with separate q, k, v, and the float64 numpy reference; one of k / v alone fails the run.
A. / C. The CPU twins accept the CUDA-only tuning attributes (SparseAttention's
   ``variant_*``, FusedGemm's ``lt_algo_*``) and compute the same result without them.
The CUDA twins' side of A, B and C is tested against the recording fake driver in
``test_ortlib_fake_gpu.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto, helper

from stofc.package.maskbin import write_mask_binary
from tests.unit.test_ortlib import (  # noqa: F401
    F16,
    F32,
    NP,
    TOL,
    attention_ref,
    dense_to_format,
    lib,
    masks,
    run_node,
    vi,
)

VARIANT_ATTRS = dict(
    variant_kernels="k.cubin:stofc_attn_row_f16_x_b0_k0;k2.cubin:stofc_attn_block_f16_x_b0_k0",
    variant_launch_plans="missing.plan.bin;also_missing.plan.bin",
    variant_block_threads=[128, 256], variant_blocks_per_tile_row=[1, 2],
    variant_smem_bytes=[0, 4096], variant_max_seq_len=[64, 0], variant_max_batch_rows=[0, 8])


def attention_inputs(rng, B, S, H, D, elem, *, kpm: bool, bias: bool):
    dt = NP[elem]
    q, k, v = (rng.standard_normal((B, S, H * D)).astype(dt) for _ in range(3))
    key_mask = None
    if kpm:
        key_mask = np.ones((B, S), np.int64)
        key_mask[-1, S // 2:] = 0       # a padded sequence
        key_mask[0, 5] = 0              # a hole
    bias_arr = (rng.standard_normal((B, H, S, S)) * 2).astype(dt) if bias else None
    return q, k, v, key_mask, bias_arr


def attention_node(names, H, D, **extra):
    while names[-1] == "":
        names = names[:-1]
    return helper.make_node("SparseAttention", names, ["out0"], domain="ai.stofc", num_heads=H,
                            head_dim=D, mask_file="m.bin", **extra)


def run_packed_and_separate(lib, tmp_path, mask, *, tile, B, S, H, D, elem, kpm, bias,  # noqa: F811
                            seed=0, **extra):
    rng = np.random.default_rng(seed)
    write_mask_binary(dense_to_format(mask, tile), tmp_path / "m.bin")
    q, k, v, key_mask, bias_arr = attention_inputs(rng, B, S, H, D, elem, kpm=kpm, bias=bias)
    tail_names = ["kpm" if kpm else "", "bias" if bias else ""]
    tail_inputs, tail_feeds = [], {}
    if kpm:
        tail_inputs.append(vi("kpm", TensorProto.INT64, ["B", "S"]))
        tail_feeds["kpm"] = key_mask
    if bias:
        tail_inputs.append(vi("bias", elem, [B, H, "S", "S"]))
        tail_feeds["bias"] = bias_arr
    HD = H * D
    separate = attention_node(["q", "k", "v", *tail_names], H, D, **extra)
    (out_sep,) = run_node(lib, separate, [vi(n, elem, ["B", "S", HD]) for n in "qkv"] + tail_inputs,
                          {"q": q, "k": k, "v": v, **tail_feeds}, package_dir=tmp_path)
    qkv = np.concatenate([q, k, v], axis=-1)
    packed = attention_node(["qkv", "", "", *tail_names], H, D, **extra)
    (out_packed,) = run_node(lib, packed, [vi("qkv", elem, ["B", "S", 3 * HD]), *tail_inputs],
                             {"qkv": qkv, **tail_feeds}, package_dir=tmp_path)
    allowed = np.broadcast_to(mask, (H, *mask.shape[1:])) if mask.shape[0] == 1 else mask
    ref = attention_ref(q, k, v, allowed, key_mask, bias_arr, H, 1 / math.sqrt(D))
    return out_packed, out_sep, ref


@pytest.mark.parametrize("elem", [F32, F16], ids=["f32", "f16"])
@pytest.mark.parametrize("kpm,bias", [(False, False), (True, False), (True, True)],
                         ids=["plain", "kpm", "kpm+bias"])
@pytest.mark.parametrize("name", ["random_per_head", "longformer"])
def test_packed_qkv_equals_separate_and_reference(lib, tmp_path, elem, kpm, bias, name):  # noqa: F811
    H, D, B, S, L = 3, 16, 2, 45, 64
    mask = masks(L, H, np.random.default_rng(11))[name]
    out_packed, out_sep, ref = run_packed_and_separate(lib, tmp_path, mask, tile=16, B=B, S=S, H=H,
                                                       D=D, elem=elem, kpm=kpm, bias=bias)
    assert out_packed.shape == out_sep.shape == (B, S, H * D)
    assert out_packed.dtype == NP[elem]
    # the same arithmetic in the same order: identical bits, not merely close
    assert np.array_equal(out_packed, out_sep)
    np.testing.assert_allclose(out_packed.astype(np.float64), ref, **TOL[elem])
    if kpm and not bias:
        assert np.isfinite(out_packed).all()


def test_packed_qkv_single_head_float16_full_length(lib, tmp_path):  # noqa: F811
    L = 128
    mask = masks(L, 1, np.random.default_rng(12))["causal"]
    out_packed, out_sep, ref = run_packed_and_separate(lib, tmp_path, mask, tile=64, B=1, S=L, H=1,
                                                       D=32, elem=F16, kpm=True, bias=False, seed=3)
    assert np.array_equal(out_packed, out_sep)
    np.testing.assert_allclose(out_packed.astype(np.float64), ref, **TOL[F16])


def _run_error(lib, tmp_path, node, inputs, feeds) -> str:  # noqa: F811
    with pytest.raises(Exception) as err:
        run_node(lib, node, inputs, feeds, package_dir=tmp_path)
    return str(err.value)


@pytest.mark.parametrize("names,given,missing", [(["q", "k"], "k", "v"), (["q", "k", ""], "k", "v"),
                                                  (["q", "", "v"], "v", "k")])
def test_one_of_k_v_omitted_fails_the_run(lib, tmp_path, names, given, missing):  # noqa: F811
    H, D, B, S = 2, 8, 1, 16
    write_mask_binary(dense_to_format(np.tril(np.ones((1, S, S), bool)), 16), tmp_path / "m.bin")
    rng = np.random.default_rng(0)
    node = attention_node(names, H, D)
    present = [n for n in names if n]
    msg = _run_error(lib, tmp_path, node, [vi(n, F32, [B, S, H * D]) for n in present],
                     {n: rng.standard_normal((B, S, H * D)).astype(np.float32) for n in present})
    assert f"stofc SparseAttention: input {missing} is omitted but {given} is given" in msg, msg
    assert "omit both to pass q packed as [B, S, 3*H*D]" in msg


def test_packed_q_of_the_wrong_width_fails_the_run(lib, tmp_path):  # noqa: F811
    H, D, B, S = 2, 8, 1, 16
    write_mask_binary(dense_to_format(np.tril(np.ones((1, S, S), bool)), 16), tmp_path / "m.bin")
    node = attention_node(["q", "", ""], H, D)
    msg = _run_error(lib, tmp_path, node, [vi("q", F32, [B, S, H * D])],
                     {"q": np.zeros((B, S, H * D), np.float32)})
    assert "input q has shape [1, 16, 16], expected [B, S, 48]" in msg, msg
    assert "k and v are omitted, so q is packed QKV" in msg


def test_cpu_twin_accepts_and_ignores_variant_attributes(lib, tmp_path):  # noqa: F811
    """The variants name files that do not exist: the CPU twin never reads them."""
    H, D, L = 2, 16, 64
    mask = masks(L, H, np.random.default_rng(13))["block_per_head"]
    plain = run_packed_and_separate(lib, tmp_path, mask, tile=32, B=2, S=50, H=H, D=D, elem=F32,
                                    kpm=True, bias=False)
    tuned = run_packed_and_separate(lib, tmp_path, mask, tile=32, B=2, S=50, H=H, D=D, elem=F32,
                                    kpm=True, bias=False, kernel="k.cubin:x", **VARIANT_ATTRS)
    for a, b in zip(plain[:2], tuned[:2], strict=True):
        assert np.array_equal(a, b)
    np.testing.assert_allclose(tuned[0], plain[2], **TOL[F32])


def test_cpu_fused_gemm_accepts_and_ignores_lt_algo_attributes(lib):  # noqa: F811
    rng = np.random.default_rng(14)
    x = rng.standard_normal((2, 5, 24)).astype(np.float32)
    w = (rng.standard_normal((24, 12)) / 5).astype(np.float32)
    inputs, feeds = [vi("x", F32, [2, 5, 24]), vi("w", F32, [24, 12])], {"x": x, "w": w}
    outs = []
    for extra in ({}, {"lt_algo_m": [10, 64], "lt_algo_rank": [3, 1]}):
        node = helper.make_node("FusedGemm", ["x", "w"], ["out0"], domain="ai.stofc",
                                activation="gelu_erf", **extra)
        outs.append(run_node(lib, node, inputs, feeds)[0])
    assert np.array_equal(outs[0], outs[1])

