"""The ai.stofc ops' CPU twins in ONNX Runtime against float64 numpy references."""

from __future__ import annotations

import math
import shutil

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from stofc.masks.format import MaskFormat
from stofc.package.maskbin import write_mask_binary
from stofc.package.ortlib import LIBRARY_NAME, build_library

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
NP = {F32: np.float32, F16: np.float16}
SHIFTS = np.arange(64, dtype=np.uint64)
TOL = {F32: dict(rtol=1e-5, atol=2e-5), F16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_library(tmp_path_factory.mktemp("lib"))


# ---------------------------------------------------------------- masks


def dense_to_format(mask: np.ndarray, tile: int) -> MaskFormat:
    """A MaskFormat of a dense bool mask ``[heads, L, L]`` (the MaskFormat contract, directly)."""
    heads, L, _ = mask.shape
    R, itn = -(-L // tile), tile // 8
    padded = np.zeros((heads, R * tile, R * tile), bool)
    padded[:, :L, :L] = mask
    full_rp, part_rp, load_rp = (np.zeros((heads, R + 1), np.int32) for _ in range(3))
    full_ci, part_ci, load_ci, load_pi, words = [], [], [], [], []
    row_nnz = np.zeros((heads, R), np.int64)
    for h in range(heads):
        for r in range(R):
            full_rp[h, r], part_rp[h, r], load_rp[h, r] = len(full_ci), len(part_ci), len(load_ci)
            for c in range(R):
                ot = padded[h, r * tile:(r + 1) * tile, c * tile:(c + 1) * tile]
                inside = (min(L, (r + 1) * tile) - r * tile) * (min(L, (c + 1) * tile) - c * tile)
                n = int(ot.sum())
                row_nnz[h, r] += n
                if n == 0:
                    continue
                load_ci.append(c)
                if n == inside:
                    full_ci.append(c)
                    load_pi.append(-1)
                    continue
                load_pi.append(len(part_ci))
                part_ci.append(c)
                w = np.zeros(itn * itn, np.uint64)
                for ir in range(itn):
                    for ic in range(itn):
                        bits = ot[ir * 8:ir * 8 + 8, ic * 8:ic * 8 + 8].reshape(64)
                        w[ic * itn + ir] = (bits.astype(np.uint64) << SHIFTS).sum(dtype=np.uint64)
                words.append(w)
        full_rp[h, R], part_rp[h, R], load_rp[h, R] = len(full_ci), len(part_ci), len(load_ci)
    i32 = lambda a: np.array(a, np.int32)  # noqa: E731
    return MaskFormat(
        spec="test", spec_hash="0" * 64, seq_len=L, tile=tile, num_heads=heads,
        full_row_ptr=full_rp, full_col_idx=i32(full_ci), part_row_ptr=part_rp,
        part_col_idx=i32(part_ci),
        part_bitmaps=np.array(words, np.uint64).reshape(len(words), itn * itn),
        load_row_ptr=load_rp, load_col_idx=i32(load_ci), load_part_idx=i32(load_pi),
        row_nnz=row_nnz, nnz=int(mask.sum()))


def masks(L: int, heads: int, rng) -> dict[str, np.ndarray]:
    q, k = np.arange(L)[:, None], np.arange(L)[None, :]
    blocks = rng.random((heads, -(-L // 8), -(-L // 8))) < 0.4
    return {
        "causal": (k <= q)[None],
        "sliding": (np.abs(q - k) <= 5)[None],
        "longformer": ((np.abs(q - k) <= 3) | (q < 2) | (k < 2))[None],
        "dense": np.ones((1, L, L), bool),
        "random_per_head": rng.random((heads, L, L)) < 0.3,
        "block_per_head": np.kron(blocks, np.ones((8, 8), bool))[:, :L, :L],
        "empty_rows": (k <= q)[None] & (q % 7 != 3),  # every 7th row has no key at all
    }


# ---------------------------------------------------------------- models


def run_node(lib, node, inputs, feeds, n_out=1, package_dir=None, library=None, keep=None):
    """Runs one ai.stofc node on the CPU EP; ``keep`` (a list) receives the session."""
    graph = helper.make_graph(
        [node], "g", inputs,
        [helper.make_tensor_value_info(f"out{i}", inputs[0].type.tensor_type.elem_type, None)
         for i in range(n_out)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.stofc", 1)])
    model.ir_version = 10
    so = ort.SessionOptions()
    if package_dir is not None:
        so.add_session_config_entry("stofc.package_dir", str(package_dir))
    so.register_custom_ops_library(str(library or lib))
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    if keep is not None:
        keep.append(sess)
    return sess.run(None, feeds)


def vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


# ---------------------------------------------------------------- SparseAttention


def attention_ref(q, k, v, allowed, kpm, bias, H, scale):
    B, S, HD = q.shape
    D = HD // H
    split = lambda t: t.astype(np.float64).reshape(B, S, H, D).transpose(0, 2, 1, 3)  # noqa: E731
    qh, kh, vh = split(q), split(k), split(v)
    s = np.einsum("bhqd,bhkd->bhqk", qh, kh) * scale
    if bias is not None:
        s = s + bias.astype(np.float64)
    ok = np.broadcast_to(allowed[None, :, :S, :S], s.shape)
    if kpm is not None:
        ok = ok & (kpm != 0)[:, None, None, :]
    s = np.where(ok, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    e = np.where(ok, np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0.0)
    den = e.sum(-1, keepdims=True)
    p = np.divide(e, den, out=np.zeros_like(e), where=den > 0)
    return np.einsum("bhqk,bhkd->bhqd", p, vh).transpose(0, 2, 1, 3).reshape(B, S, HD)


def run_attention(lib, tmp_path, mask, *, tile, B, S, H, D, elem=F32, kpm=None, kpm_elem=None,
                  bias_shape=None, seed=0, scale=None):
    rng = np.random.default_rng(seed)
    write_mask_binary(dense_to_format(mask, tile), tmp_path / "masks" / "m.bin")
    dt = NP[elem]
    q, k, v = (rng.standard_normal((B, S, H * D)).astype(dt) for _ in range(3))
    inputs = [vi("q", elem, ["B", "S", H * D]), vi("k", elem, ["B", "S", H * D]),
              vi("v", elem, ["B", "S", H * D])]
    names, feeds = ["q", "k", "v", "", ""], {"q": q, "k": k, "v": v}
    if kpm is not None:
        names[3] = "kpm"
        inputs.append(vi("kpm", kpm_elem, ["B", "S"]))
        feeds["kpm"] = kpm.astype({TensorProto.INT64: np.int64, TensorProto.INT32: np.int32,
                                   TensorProto.BOOL: bool}[kpm_elem])
    bias = None
    if bias_shape is not None:
        bias = (rng.standard_normal(bias_shape) * 2).astype(dt)
        names[4] = "bias"
        inputs.append(vi("bias", elem, list(bias_shape)))
        feeds["bias"] = bias
    while names[-1] == "":
        names.pop()
    attrs = dict(num_heads=H, head_dim=D, mask_file="masks/m.bin")
    if scale is not None:
        attrs["scale"] = scale
    node = helper.make_node("SparseAttention", names, ["out0"], domain="ai.stofc", **attrs)
    (out,) = run_node(lib, node, inputs, feeds, package_dir=tmp_path)
    allowed = np.broadcast_to(mask, (H, *mask.shape[1:])) if mask.shape[0] == 1 else mask
    ref = attention_ref(q, k, v, allowed, kpm, bias, H,
                        scale if scale is not None else 1 / math.sqrt(D))
    return out, ref


@pytest.mark.parametrize("name", ["causal", "sliding", "longformer", "dense", "random_per_head",
                                  "block_per_head", "empty_rows"])
def test_attention_masks(lib, tmp_path, name):
    L, H = 40, 2
    mask = masks(L, H, np.random.default_rng(1))[name]
    out, ref = run_attention(lib, tmp_path, mask, tile=16, B=2, S=37, H=H, D=8)
    assert out.dtype == np.float32 and out.shape == (2, 37, 16)
    np.testing.assert_allclose(out, ref, **TOL[F32])
    if name == "empty_rows":
        assert np.all(out[:, 3::7] == 0) and np.isfinite(out).all()


@pytest.mark.parametrize("kpm_elem", [TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL])
def test_attention_padding_and_bias(lib, tmp_path, kpm_elem):
    L, H, B, S = 64, 3, 3, 50
    mask = masks(L, H, np.random.default_rng(2))["random_per_head"]
    kpm = np.ones((B, S), np.int64)
    kpm[1, 30:] = 0       # a padded sequence
    kpm[2, :] = 0         # a batch row with no real key: all zeros
    out, ref = run_attention(lib, tmp_path, mask, tile=32, B=B, S=S, H=H, D=16, kpm=kpm,
                             kpm_elem=kpm_elem, bias_shape=(1, H, S, S), scale=0.3)
    np.testing.assert_allclose(out, ref, **TOL[F32])
    assert np.all(out[2] == 0)


def test_attention_batch_bias_float16(lib, tmp_path):
    L, H, B, S = 128, 2, 2, 128
    mask = masks(L, H, np.random.default_rng(3))["longformer"]
    kpm = np.ones((B, S), np.int64)
    kpm[0, 100:] = 0
    out, ref = run_attention(lib, tmp_path, mask, tile=64, B=B, S=S, H=H, D=32, elem=F16, kpm=kpm,
                             kpm_elem=TensorProto.INT64, bias_shape=(B, 1, S, S))
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float64), ref, **TOL[F16])


def test_mask_resolved_next_to_the_library(lib, tmp_path):
    """Without the config entry, mask_file is relative to the directory of libstofc_ort.so."""
    L = 16
    mask = np.tril(np.ones((1, L, L), bool))
    write_mask_binary(dense_to_format(mask, 16), tmp_path / "mask.bin")
    shutil.copy(lib, tmp_path / LIBRARY_NAME)
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, L, 8)).astype(np.float32)
    node = helper.make_node("SparseAttention", ["q", "q", "q"], ["out0"], domain="ai.stofc",
                            num_heads=1, head_dim=8, mask_file="mask.bin")
    (out,) = run_node(lib, node, [vi("q", F32, [1, L, 8])], {"q": q},
                      library=tmp_path / LIBRARY_NAME)
    ref = attention_ref(q, q, q, mask, None, None, 1, 1 / math.sqrt(8))
    np.testing.assert_allclose(out, ref, **TOL[F32])


# ---------------------------------------------------------------- FusedGemm


def gelu(x, kind):
    if kind == "gelu_erf":
        return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    if kind == "gelu_tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return x


@pytest.mark.parametrize("elem", [F32, F16])
@pytest.mark.parametrize("activation", ["none", "gelu_erf", "gelu_tanh"])
@pytest.mark.parametrize("residual", [None, 0, 1])
def test_fused_gemm(lib, elem, activation, residual):
    rng = np.random.default_rng(5)
    dt = NP[elem]
    x = rng.standard_normal((2, 5, 24)).astype(dt)
    w = (rng.standard_normal((24, 12)) / 5).astype(dt)
    b = rng.standard_normal(12).astype(dt)
    r = rng.standard_normal((2, 5, 12)).astype(dt)
    names = ["x", "w", "b"] + (["r"] if residual is not None else [])
    attrs = {"activation": activation}
    if residual is not None:
        attrs["residual_after_activation"] = residual
    node = helper.make_node("FusedGemm", names, ["out0"], domain="ai.stofc", **attrs)
    inputs = [vi("x", elem, [2, "S", 24]), vi("w", elem, [24, 12]), vi("b", elem, [12]),
              vi("r", elem, [2, "S", 12])][:len(names)]
    feeds = dict(zip(names, [x, w, b, r], strict=False))
    (y,) = run_node(lib, node, inputs, feeds)
    t = x.astype(np.float64) @ w.astype(np.float64) + b
    r64 = r.astype(np.float64)
    if residual == 0:
        t = t + r64
    t = gelu(t, activation)
    if residual == 1:
        t = t + r64
    assert y.dtype == dt and y.shape == (2, 5, 12)
    np.testing.assert_allclose(y.astype(np.float64), t, **TOL[elem])


def test_fused_gemm_without_bias(lib):
    rng = np.random.default_rng(6)
    x, w = rng.standard_normal((7, 9)).astype(np.float32), rng.standard_normal((9, 4)).astype(np.float32)
    node = helper.make_node("FusedGemm", ["x", "w"], ["out0"], domain="ai.stofc")
    (y,) = run_node(lib, node, [vi("x", F32, [7, 9]), vi("w", F32, [9, 4])], {"x": x, "w": w})
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, **TOL[F32])


# ---------------------------------------------------------------- AddLayerNorm


@pytest.mark.parametrize("elem", [F32, F16])
@pytest.mark.parametrize("rms", [0, 1])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_layer_norm(lib, elem, rms, with_residual):
    rng = np.random.default_rng(7)
    dt = NP[elem]
    x = (rng.standard_normal((3, 4, 32)) * 3 + 1).astype(dt)
    r = rng.standard_normal((3, 4, 32)).astype(dt)
    g = rng.standard_normal(32).astype(dt)
    be = rng.standard_normal(32).astype(dt)
    names = ["x", "r" if with_residual else "", "g", "be"]
    node = helper.make_node("AddLayerNorm", names, ["out0", "out1"], domain="ai.stofc",
                            epsilon=1e-5, rms=rms)
    inputs = [vi("x", elem, [3, 4, 32]), vi("g", elem, [32]), vi("be", elem, [32])]
    feeds = {"x": x, "g": g, "be": be}
    if with_residual:
        inputs.append(vi("r", elem, [3, 4, 32]))
        feeds["r"] = r
    y, s = run_node(lib, node, inputs, feeds, n_out=2)
    h = x.astype(np.float64) + (r.astype(np.float64) if with_residual else 0)
    if rms:
        ref = h / np.sqrt((h**2).mean(-1, keepdims=True) + 1e-5)
    else:
        ref = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5)
    ref = ref * g.astype(np.float64) + be.astype(np.float64)
    np.testing.assert_allclose(y.astype(np.float64), ref, **TOL[elem])
    np.testing.assert_allclose(s.astype(np.float64), h, **TOL[elem])


def test_add_layer_norm_single_output_no_beta(lib):
    rng = np.random.default_rng(8)
    x, g = rng.standard_normal((5, 16)).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    node = helper.make_node("AddLayerNorm", ["x", "", "g"], ["out0"], domain="ai.stofc")
    (y,) = run_node(lib, node, [vi("x", F32, [5, 16]), vi("g", F32, [16])], {"x": x, "g": g})
    h = x.astype(np.float64)
    ref = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5) * g
    np.testing.assert_allclose(y, ref, **TOL[F32])


# ---------------------------------------------------------------- with stofc's own mask encoder


@pytest.mark.parametrize(("spec", "L", "tile"), [
    ("causal", 100, 16),
    ("bigbird:block=16,window=3,global=1,random=2,seed=0", 128, 32),
    ("longformer:window=5,global=2", 70, 64),
    ("sliding:window=8,causal=true", 64, 16),
    ("per_head.yaml", 50, 16),
])
def test_attention_with_encoded_masks(lib, tmp_path, spec, L, tile):
    """Formats from stofc.masks.encode; the reference mask is their decoded dense form."""
    from stofc.masks import encode, parse_mask, to_dense

    H = 3
    if spec.endswith(".yaml"):
        (tmp_path / spec).write_text(
            'mask:\n  sliding: {window: 4}\nheads:\n  "1": {causal: {}}\n'
            '  "2": {bigbird: {block: 16, window: 1, global: 1, random: 1, seed: 3}}\n')
        spec = str(tmp_path / spec)
    fmt = encode(parse_mask(spec), L, tile=tile, num_heads=H)
    dense = np.stack([to_dense(fmt, head=h) for h in range(fmt.num_heads)])
    # the test's own converter and the encoder agree array for array
    mine = dense_to_format(dense, tile)
    for name in ("full_row_ptr", "full_col_idx", "part_row_ptr", "part_col_idx", "part_bitmaps",
                 "load_row_ptr", "load_col_idx", "load_part_idx", "row_nnz"):
        np.testing.assert_array_equal(np.ravel(getattr(mine, name)), np.ravel(getattr(fmt, name)))
    rng = np.random.default_rng(9)
    B, S, D = 2, L - 3, 16
    write_mask_binary(fmt, tmp_path / "enc.bin")
    q, k, v = (rng.standard_normal((B, S, H * D)).astype(np.float32) for _ in range(3))
    kpm = np.ones((B, S), np.int64)
    kpm[1, S // 2:] = 0
    node = helper.make_node("SparseAttention", ["q", "k", "v", "kpm"], ["out0"], domain="ai.stofc",
                            num_heads=H, head_dim=D, mask_file="enc.bin")
    inputs = [vi(n, F32, [B, S, H * D]) for n in "qkv"] + [vi("kpm", TensorProto.INT64, [B, S])]
    (out,) = run_node(lib, node, inputs, {"q": q, "k": k, "v": v, "kpm": kpm}, package_dir=tmp_path)
    allowed = np.broadcast_to(dense, (H, L, L))
    np.testing.assert_allclose(out, attention_ref(q, k, v, allowed, kpm, None, H, 1 / math.sqrt(D)),
                               **TOL[F32])


# ---------------------------------------------------------------- grouped-query attention, soft-capping


def _gqa_ref(q, k, v, allowed, kpm, H, Hkv, D, scale, softcap):
    """float64 reference with K/V heads repeated (query head h reads K/V head h // (H/Hkv))."""
    B, S, _ = q.shape
    rep = lambda t, n: np.repeat(t.astype(np.float64).reshape(B, S, n, D), H // n, axis=2)  # noqa: E731
    qh = q.astype(np.float64).reshape(B, S, H, D).transpose(0, 2, 1, 3)
    kh, vh = (rep(t, Hkv).transpose(0, 2, 1, 3) for t in (k, v))
    s = np.einsum("bhqd,bhkd->bhqk", qh, kh) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    ok = np.broadcast_to(allowed[None, :, :S, :S], s.shape) & (kpm != 0)[:, None, None, :]
    s = np.where(ok, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    e = np.where(ok, np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0.0)
    den = e.sum(-1, keepdims=True)
    p = np.divide(e, den, out=np.zeros_like(e), where=den > 0)
    return np.einsum("bhqk,bhkd->bhqd", p, vh).transpose(0, 2, 1, 3).reshape(B, S, H * D)


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize(("Hkv", "softcap"), [(1, 0.0), (2, 0.0), (2, 5.0), (6, 5.0)])
def test_attention_grouped_query_and_softcap(lib, tmp_path, Hkv, softcap, packed):
    """kv_num_heads < num_heads reads K/V head h // (H / Hkv) without expanding them, in
    separate [B, S, Hkv*D] tensors or packed [Q | K | V] rows; softcap caps the scaled
    scores before the mask (large scores so that the tanh saturates)."""
    B, S, H, D = 2, 70, 6, 16
    rng = np.random.default_rng(3)
    mask = masks(S, 1, rng)["sliding"]
    write_mask_binary(dense_to_format(mask, 16), tmp_path / "masks" / "m.bin")
    q = (rng.standard_normal((B, S, H * D)) * 3).astype(np.float32)
    k, v = (rng.standard_normal((B, S, Hkv * D)).astype(np.float32) for _ in range(2))
    kpm = np.ones((B, S), np.int64)
    kpm[1, 50:] = 0
    attrs = dict(num_heads=H, head_dim=D, mask_file="masks/m.bin", kv_num_heads=Hkv)
    if softcap:
        attrs["softcap"] = softcap
    if packed:
        qkv = np.concatenate([q, k, v], axis=-1)
        node = helper.make_node("SparseAttention", ["qkv", "", "", "kpm"], ["out0"],
                                domain="ai.stofc", **attrs)
        inputs = [vi("qkv", F32, ["B", "S", (H + 2 * Hkv) * D]), vi("kpm", TensorProto.INT64, ["B", "S"])]
        feeds = {"qkv": qkv, "kpm": kpm}
    else:
        node = helper.make_node("SparseAttention", ["q", "k", "v", "kpm"], ["out0"],
                                domain="ai.stofc", **attrs)
        inputs = [vi("q", F32, ["B", "S", H * D]), vi("k", F32, ["B", "S", Hkv * D]),
                  vi("v", F32, ["B", "S", Hkv * D]), vi("kpm", TensorProto.INT64, ["B", "S"])]
        feeds = {"q": q, "k": k, "v": v, "kpm": kpm}
    (out,) = run_node(lib, node, inputs, feeds, package_dir=tmp_path)
    ref = _gqa_ref(q, k, v, np.broadcast_to(mask, (H, S, S)), kpm, H, Hkv, D, 1 / math.sqrt(D),
                   softcap)
    np.testing.assert_allclose(out, ref, **TOL[F32])
    if softcap:   # the cap changes the result (the test would pass without it otherwise)
        plain = _gqa_ref(q, k, v, np.broadcast_to(mask, (H, S, S)), kpm, H, Hkv, D,
                         1 / math.sqrt(D), 0.0)
        assert np.abs(plain - ref).max() > 1e-2


@pytest.mark.parametrize(("attrs", "message"), [
    (dict(kv_num_heads=4), "kv_num_heads=4 must be >= 1 and divide num_heads=6"),
    (dict(softcap=-1.0), "softcap must be a finite number >= 0"),
    (dict(kv_num_heads=2), "input k has shape"),
])
def test_attention_grouped_query_errors(lib, tmp_path, attrs, message):
    B, S, H, D = 1, 16, 6, 16
    write_mask_binary(dense_to_format(np.ones((1, S, S), bool), 16), tmp_path / "masks" / "m.bin")
    x = np.zeros((B, S, H * D), np.float32)
    node = helper.make_node("SparseAttention", ["q", "k", "v"], ["out0"], domain="ai.stofc",
                            num_heads=H, head_dim=D, mask_file="masks/m.bin", **attrs)
    inputs = [vi("q", F32, ["B", "S", H * D]), vi("k", F32, ["B", "S", H * D]),
              vi("v", F32, ["B", "S", H * D])]
    with pytest.raises(Exception, match=message):
        run_node(lib, node, inputs, {"q": x, "k": x, "v": x}, package_dir=tmp_path)
