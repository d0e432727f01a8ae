"""The AttentionBlock says enough to recompute the attention: checked against ONNX Runtime.

For every committed fixture and several hand-built variants, ONNX Runtime runs
the canonicalized model with the block's inputs (q/k/v, mask, bias) and output
exposed; numpy recomputes multi-head attention from the inputs using only the
block's description (num_heads, head_dim, packed_qkv, scale, mask form) and
must match the graph's own output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from graphs import build

from stofc.frontend import load_model
from stofc.frontend.graph import GraphIndex
from stofc.package.feeds import input_shape

ort = pytest.importorskip("onnxruntime")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
BATCH, SEQ = 2, 12


def _heads(x: np.ndarray, batch: int, heads: int, dim: int, layout: str = "bsf") -> np.ndarray:
    """[B, H, S, D] from the block's layout of one input."""
    if layout == "bhsd":
        return x
    if layout == "bshd":
        return x.transpose(0, 2, 1, 3)
    return x.reshape(batch, -1, heads, dim).transpose(0, 2, 1, 3)


def reference(att, values: dict[str, np.ndarray], batch: int) -> np.ndarray:
    """Multi-head attention from the block's description alone, in float64: layouts,
    K/V heads shared by ``num_heads / kv_heads`` query heads, soft-capping."""
    h, d, kvh = att.num_heads, att.head_dim, att.kv_heads
    if att.packed_qkv:  # q | k | v concatenated on the last axis
        q, k, v = np.split(values[att.q_input].astype(np.float64), 3, axis=-1)
    else:
        q, k, v = (values[n].astype(np.float64) for n in (att.q_input, att.k_input,
                                                             att.v_input))
    q = _heads(q, batch, h, d, att.q_layout)
    k, v = (_heads(t, batch, kvh, d, lay) for t, lay in ((k, att.k_layout), (v, att.v_layout)))
    assert q.shape[1] == h and k.shape[1] == v.shape[1] == kvh
    k, v = (np.repeat(t, h // kvh, axis=1) for t in (k, v))   # query head i reads i // group
    scores = att.scale * q @ k.transpose(0, 1, 3, 2)
    if att.softcap:
        scores = att.softcap * np.tanh(scores / att.softcap)
    assert (att.mask_input is None) == (not att.mask_inputs)
    for name, how in att.mask_inputs:
        mask = values[name]
        if how == "keep":
            scores = np.where(mask, scores, -np.inf)
        else:
            scores = scores + mask.astype(np.float64)
    scores = scores - scores.max(-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(-1, keepdims=True)
    out = (probs @ v).transpose(0, 2, 1, 3)
    return out.reshape(batch, -1, h * d)


def _run(model: onnx.ModelProto, names: list[str], feeds: dict) -> dict[str, np.ndarray]:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    known = {o.name for o in model.graph.output}
    for name in names:
        if name not in known:
            model.graph.output.append(onnx.ValueInfoProto(name=name))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    wanted = [o.name for o in sess.get_outputs() if o.name in names]
    return dict(zip(wanted, sess.run(wanted, feeds), strict=True))


def _feeds(graph, rng) -> dict:
    feeds = {}
    for vi in graph.inputs:
        if vi.name == "pixel_values":
            shape = input_shape(graph, GraphIndex(graph.model), vi, BATCH, SEQ, {})
            feeds[vi.name] = rng.standard_normal(shape).astype(vi.dtype)
        elif vi.name == "attention_mask":
            mask = np.ones((BATCH, SEQ), np.int64)
            mask[1, SEQ - 4:] = 0  # padding in the second sequence
            feeds[vi.name] = mask
        elif vi.name == "input_ids":
            feeds[vi.name] = rng.integers(0, 32, (BATCH, SEQ)).astype(np.int64)
        else:
            shape = [BATCH if i == 0 else SEQ if not isinstance(s, int) else s
                     for i, s in enumerate(vi.shape)]
            if np.issubdtype(np.dtype(vi.dtype), np.integer):  # token_type_ids, ...
                feeds[vi.name] = np.zeros(shape, vi.dtype)
            else:
                feeds[vi.name] = rng.standard_normal(shape).astype(vi.dtype)
    return feeds


def _check(graph, rtol):
    rng = np.random.default_rng(0)
    feeds = _feeds(graph, rng)
    names = []
    for layer in graph.layers:
        a = layer.attention
        names += [a.q_input, a.k_input, a.v_input, a.output] + [m for m, _ in a.mask_inputs]
    values = _run(graph.model, list(dict.fromkeys(names)), feeds)
    for layer in graph.layers:
        a = layer.attention
        want = values[a.output].astype(np.float64).reshape(BATCH, -1, a.hidden_size)
        got = reference(a, values, BATCH)
        # padded query rows of the second sequence may differ in how they are masked
        np.testing.assert_allclose(got[0], want[0], rtol=rtol, atol=rtol)
        np.testing.assert_allclose(got[1, :SEQ - 4], want[1, :SEQ - 4], rtol=rtol, atol=rtol)


@pytest.mark.parametrize("name", sorted(e["file"] for e in MANIFEST["fixtures"]))
def test_fixture_attention_recomputes(name):
    entry = next(e for e in MANIFEST["fixtures"] if e["file"] == name)
    graph = load_model(FIXTURES / name)
    _check(graph, rtol=2e-2 if entry.get("dtype") == "float16" else 1e-4)


@pytest.mark.parametrize("variant", [
    {"qkv": "fused_split"}, {"qkv": "fused_gather"}, {"qkv": "gemm"},
    {"scale": "split_qk"}, {"scale": "mul"}, {"mask": "where_bool"},
    {"mask": "t5_bias_mask", "bias": False, "norm": "rms_decomposed", "order": "pre",
     "scale": "none"},
    {"mask": "causal"}, {"mask": "additive_where"}, {"guard": True}, {"attention_op": True},
    {"attention_op": True, "mask": "where_bool"}, {"k_layout": "transpose_after"},
])
def test_variant_attention_recomputes(tmp_path, variant):
    path = tmp_path / "m.onnx"
    onnx.save(build(layers=[variant, variant]), str(path))
    _check(load_model(path), rtol=1e-4)


def _as_read(x: np.ndarray, batch: int, heads: int, dim: int, layout: str) -> np.ndarray:
    """[B, S, heads, D] -> the layout the attention reads it in."""
    return {"bsf": x.reshape(batch, -1, heads * dim), "bshd": x,
            "bhsd": x.transpose(0, 2, 1, 3)}[layout]


@pytest.mark.parametrize("name", sorted(e["file"] for e in MANIFEST["fixtures"]
                                        if any(x in e["arch"] for x in ("llama", "mistral",
                                               "qwen2", "phi3", "gemma", "modernbert"))))
def test_fixture_rope_fusion_recomputes(name):
    """The RopeFusion says enough to recompute the rotated Q, K and V the attention reads:
    ONNX Runtime runs the model on real inputs with the op's inputs (its sources and cos /
    sin) and the block's q/k/v exposed, and the op's function
    (:func:`stofc.kernels.rotary.rotary_reference`) of those values, laid out per the block's
    layouts, must match them."""
    from stofc.kernels.rotary import rotary_reference

    graph = load_model(FIXTURES / name)
    rng = np.random.default_rng(0)
    names = []
    for a in graph.attention:
        f = a.rope_fusion
        assert f is not None, a.rope_refusal
        names += [a.q_input, a.k_input, a.v_input, f.cos, f.sin, *(s.value for s in f.sources)]
    values = _run(graph.model, list(dict.fromkeys(names)), _feeds(graph, rng))
    for a in graph.attention:
        f = a.rope_fusion
        h, kvh, d = a.num_heads, a.kv_heads, a.head_dim

        def flat(value: str, layout: str, heads: int, d: int = d) -> np.ndarray:
            x = values[value].astype(np.float64)
            if layout == "bhsd":
                x = x.transpose(0, 2, 1, 3)
            return x.reshape(BATCH, -1, heads * d)

        tables = [values[t].astype(np.float64) for t in (f.cos, f.sin)]
        if f.squeeze is not None:
            tables = [t.squeeze(f.squeeze) for t in tables]
        if f.packed:
            args = (flat(f.sources[0].value, "bsf", h + 2 * kvh), None, None)
        else:
            args = tuple(flat(s.value, s.layout, n) for s, n in zip(f.sources, (h, kvh, kvh),
                                                                     strict=True))
        out = rotary_reference(*args, *tables, num_heads=h, kv_heads=kvh, head_dim=d,
                               rotary_dim=f.rotary_dim, interleaved=f.form == "interleaved")
        parts = np.split(out, [h * d, (h + kvh) * d], axis=-1)
        for part, heads, value, layout in zip(parts, (h, kvh, kvh),
                                              (a.q_input, a.k_input, a.v_input),
                                              (a.q_layout, a.k_layout, a.v_layout), strict=True):
            want = values[value].astype(np.float64)
            got = _as_read(part.reshape(BATCH, -1, heads, d), BATCH, heads, d, layout)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
