"""Every attention / downstream pattern variant, each in an onnx.helper graph that contains it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from graphs import build

from stofc.errors import ModelError
from stofc.frontend import OpKind, load_model

POST = ["gemm", "bias_add", "gemm", "bias_add", "gemm", "bias_add", "attention", "gemm",
        "bias_add", "residual_add", "layernorm", "gemm", "bias_add", "gelu", "gemm", "bias_add",
        "residual_add", "layernorm"]
PRE = ["layernorm", *POST[:-1]]
PACKED_POST = ["gemm", "bias_add", *POST[6:]]
T5 = ["rmsnorm", "gemm", "gemm", "gemm", "attention", "gemm", "residual_add", "rmsnorm", "gemm",
      "activation", "gemm", "residual_add"]
T5_LIKE = {"bias": False, "norm": "rms_decomposed", "order": "pre", "act": "relu", "scale": "none"}

# (variant, expected attention fields, expected chain kinds)
CASES = {
    "separate_div": ({}, {"scale_form": "div_scores", "mask_form": "additive",
                          "mask_source": "attention_mask", "packed_qkv": False}, POST),
    "fused_split": ({"qkv": "fused_split"}, {"packed_qkv": True}, PACKED_POST),
    "fused_gather": ({"qkv": "fused_gather"}, {"packed_qkv": True}, PACKED_POST),
    "gemm_transB": ({"qkv": "gemm"}, {"packed_qkv": False}, POST),
    "k_transpose_after": ({"k_layout": "transpose_after"}, {"scale_form": "div_scores"}, POST),
    "mul_scores": ({"scale": "mul"}, {"scale_form": "mul_scores"}, POST),
    "split_sqrt_qk": ({"scale": "split_qk"}, {"scale_form": "split_qk"}, POST),
    "no_scale": ({"scale": "none"}, {"scale_form": "none"}, POST),
    "no_mask": ({"mask": "none"}, {"mask_form": "none", "mask_source": None}, POST),
    "where_bool": ({"mask": "where_bool"}, {"mask_form": "boolean_where",
                                            "mask_source": "attention_mask"}, POST),
    "t5_bias": ({"mask": "t5_bias", **T5_LIKE}, {"mask_form": "relative_bias",
                                                 "mask_source": None, "scale_form": "none"}, T5),
    "t5_bias_mask": ({"mask": "t5_bias_mask", **T5_LIKE},
                     {"mask_form": "relative_bias+additive", "mask_source": "attention_mask"}, T5),
    "causal_pre_tanh": ({"mask": "causal", "order": "pre", "act": "tanh"},
                        {"causal_in_graph": True, "mask_source": None}, PRE),
    "softmax_guard": ({"guard": True}, {"softmax_guarded": True}, POST),
    "additive_and_where": ({"mask": "additive_where"},
                           {"mask_form": "additive+boolean_where", "causal_in_graph": True,
                            "mask_source": "attention_mask"}, POST),
    "onnx_attention": ({"attention_op": True}, {"scale_form": "onnx_attention",
                                                "mask_source": "attention_mask"}, POST),
    "onnx_attention_bool": ({"attention_op": True, "mask": "where_bool"},
                            {"mask_form": "boolean"}, POST),
    "ln_decomposed": ({"norm": "ln_decomposed"}, {}, POST),
    "rms_op": ({"norm": "rms_op"}, {}, [k.replace("layernorm", "rmsnorm") for k in POST]),
    "gelu_op": ({"act": "gelu_op"}, {}, POST),
    "gelu_tanh": ({"act": "tanh"}, {}, POST),
    "pre_ln": ({"order": "pre"}, {}, PRE),
}


def _load(tmp_path, model: onnx.ModelProto, name: str = "m.onnx"):
    path = tmp_path / name
    onnx.save(model, str(path))
    return load_model(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_variant_is_recognised(tmp_path, case):
    variant, fields, kinds = CASES[case]
    graph = _load(tmp_path, build(layers=[variant, variant]))
    assert graph.unsupported == ()
    assert len(graph.layers) == 2
    for i, layer in enumerate(graph.layers):
        att = layer.attention
        assert (att.layer, att.num_heads, att.head_dim, att.hidden_size) == (i, 4, 16, 64)
        for key, want in fields.items():
            got = getattr(att, key)
            assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
        want_scale = 1.0 if variant.get("scale") == "none" else 0.25
        assert att.scale == pytest.approx(want_scale)
        assert [op.kind.value for op in layer.chain] == kinds
        assert layer.norm_order == ("pre" if kinds[0] in ("layernorm", "rmsnorm") else "post")
        assert [op.index for op in layer.chain] == list(range(len(kinds)))
    covered = {n for layer in graph.layers for op in layer.chain for n in op.nodes}
    ops = {n.name: n.op_type for n in graph.model.graph.node}
    core = {"Softmax", "Attention", "MatMul", "Gemm", "LayerNormalization", "RMSNormalization",
            "Erf", "Tanh", "Gelu", "Relu"}
    # every compute node of the layers is in some chain op; nothing covered is also left
    assert not [n for n in graph.left_to_ort if ops[n] in core]
    assert not covered & set(graph.left_to_ort)


def test_chain_params(tmp_path):
    graph = _load(tmp_path, build(layers=[{"qkv": "gemm", "norm": "ln_decomposed"}]))
    chain = graph.layers[0].chain
    q = chain[0]
    assert (q.kind, q.role, q.param("weight_layout"), q.param("fused_bias")) == (
        OpKind.GEMM, "q", "NK", True)
    assert (q.param("in_features"), q.param("out_features")) == (64, 64)
    gemm_node = next(n for n in q.nodes if n.endswith("_Gemm"))
    assert q.outputs == () and q.inputs == ("x",)
    assert chain[1].kind == OpKind.BIAS_ADD and gemm_node in chain[1].nodes
    assert chain[1].inputs == () and len(chain[1].outputs) == 1
    ffn_in = next(op for op in chain if op.role == "ffn_in" and op.kind == OpKind.GEMM)
    assert (ffn_in.param("in_features"), ffn_in.param("out_features"),
            ffn_in.param("weight_layout")) == (64, 96, "KN")
    ln = next(op for op in chain if op.kind == OpKind.LAYERNORM)
    assert ln.param("form") == "decomposed" and ln.param("epsilon") == pytest.approx(1e-5)
    assert ln.param("scale") and ln.param("bias")
    weights = {t.name for t in graph.model.graph.initializer}
    assert ln.param("scale") in weights and ffn_in.param("weight") in weights
    gelu = next(op for op in chain if op.kind == OpKind.GELU)
    assert (gelu.param("approximation"), gelu.param("form")) == ("none", "erf")


def test_gelu_and_norm_params(tmp_path):
    graph = _load(tmp_path, build(layers=[{"act": "tanh", "norm": "rms_op"}]))
    chain = graph.layers[0].chain
    gelu = next(op for op in chain if op.kind == OpKind.GELU)
    assert gelu.param("approximation") == "tanh"
    rms = next(op for op in chain if op.kind == OpKind.RMSNORM)
    assert (rms.param("form"), rms.param("epsilon")) == ("op", pytest.approx(1e-6))
    t5 = _load(tmp_path, build(layers=[{"mask": "t5_bias", **T5_LIKE}]), "t5.onnx")
    rms = t5.layers[0].chain[0]
    assert rms.param("form") == "decomposed" and rms.param("epsilon") == pytest.approx(1e-6)
    assert t5.layers[0].attention.bias_input is not None
    act = next(op for op in t5.layers[0].chain if op.kind == OpKind.ACTIVATION)
    assert act.param("op") == "Relu"


def test_soft_capping_is_recognised(tmp_path):
    """cap * tanh(scores / cap) (Gemma 2) is the block's ``softcap``, not a refusal."""
    graph = _load(tmp_path, build(layers=[{}, {"softcap": True}]))
    assert len(graph.layers) == 2 and graph.unsupported == ()
    assert [layer.attention.softcap for layer in graph.layers] == [0.0, 50.0]


def test_classifier_softmax_is_not_attention(tmp_path):
    graph = _load(tmp_path, build(classifier=True))
    assert len(graph.layers) == 1 and graph.unsupported == ()
    softmaxes = [n.name for n in graph.model.graph.node if n.op_type == "Softmax"]
    assert len(softmaxes) == 2 and softmaxes[-1] in graph.left_to_ort
    assert softmaxes[0] in graph.layers[0].attention.nodes


def test_contrib_attention_is_listed_as_left_to_ort(tmp_path):
    model = build()
    model.graph.node.append(onnx.helper.make_node(
        "MultiHeadAttention", ["x", "x", "x"], ["mha_out"], name="ort_mha",
        domain="com.microsoft", num_heads=4))
    model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    model.graph.output.append(onnx.helper.make_tensor_value_info("mha_out", 1, None))
    graph = _load(tmp_path, model)
    assert len(graph.layers) == 1
    [why] = graph.unsupported
    assert (why.node, why.op_type) == ("ort_mha", "MultiHeadAttention")
    assert "ort_mha" in graph.left_to_ort


def test_dynamic_head_count_is_an_error(tmp_path):
    with pytest.raises(ModelError, match="head count is not a constant"):
        _load(tmp_path, build(layers=[{"dynamic_heads": True}]))


def test_padding_mask_input(tmp_path):
    assert _load(tmp_path, build()).padding_mask_input == "attention_mask"
    assert _load(tmp_path, build(mask="none"), "n.onnx").padding_mask_input is None


@pytest.mark.parametrize("case", ["separate_div", "gemm_transB", "fused_gather", "t5_bias_mask",
                                  "causal_pre_tanh", "onnx_attention", "rms_op"])
def test_test_graphs_run_in_onnxruntime(tmp_path, case):
    """The hand-built graphs are real models: ONNX Runtime runs them to finite outputs."""
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "m.onnx"
    onnx.save(build(layers=[CASES[case][0]]), str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 8, 64)).astype(np.float32)}
    if any(i.name == "attention_mask" for i in sess.get_inputs()):
        feeds["attention_mask"] = np.ones((2, 8), np.int64)
    out = sess.run(None, feeds)[0]
    assert out.shape == (2, 8, 64) and np.isfinite(out).all()
