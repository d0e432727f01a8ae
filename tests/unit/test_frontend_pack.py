"""The frontend's Q, K, V packing pass (``stofc.frontend.pack``) and the compile path using it.

Checked: the BERT-like fixtures pack into one MatMul + Add + Split per layer whose
outputs equal the original model's on ORT's CPU EP; the concatenation follows the
attention's Q, K, V (not graph order); the plan then has one ``qkv`` GEMM segment of
``n0 = 3 * hidden`` per layer; the cases that must not pack; the package built from
the packed graph equals the one packed at rewrite time; plan.json records it, so
``recompile_package`` packs too and the tuned cuBLASLt rank reaches the packed node.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from stofc.frontend import OpKind, load_model
from stofc.frontend.load import canonicalize
from stofc.frontend.pack import pack_projections
from stofc.lower.rewrite import DOMAIN
from stofc.package.load import read_plan
from stofc.package.ortlib import build_library
from stofc.package.verify import make_inputs
from stofc.pipeline import Instruments, compile_model, recompile_package
from stofc.plan.build import build_plan
from stofc.targets import get_profile
from tests.unit.rewrite_helpers import cpu_session, rewrite_graph, with_lt_rank

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(ROOT / "examples"))
from build_model import build_model  # noqa: E402

MASK = "bigbird:block=16,window=3,global=1,random=1,seed=0"
L_MAX = 128
HIDDEN = 128   # build_model's default


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def assert_same_function(a: onnx.ModelProto, b: onnx.ModelProto, graph, rtol: float) -> None:
    feeds, _ = make_inputs(graph, 2, 19, np.random.default_rng(1))
    for x, y in zip(run(a, feeds), run(b, feeds), strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        scale = float(np.abs(x.astype(np.float64)).max())
        assert scale > 0 and float(np.abs(x.astype(np.float64) - y).max()) <= rtol * scale


def node(model: onnx.ModelProto, prefix: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name.startswith(prefix))


def init(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def qkv_ops(graph, layer: int) -> list:
    return [op for op in graph.layers[layer].chain
            if op.kind == OpKind.GEMM and op.role in ("qkv", "q", "k", "v")]


@pytest.mark.parametrize("name,rtol", [("bert_ts_op17", 1e-6), ("bert_dynamo_op18", 1e-6),
                                       ("bert_dynamo_op18_fp16", 1e-3),
                                       ("distilbert_ts_op17", 1e-6), ("t5_ts_op17", 1e-6)])
def test_fixtures_pack_one_projection_per_layer_same_function(name, rtol):
    graph = load_model(FIXTURES / f"{name}.onnx")
    result = pack_projections(graph.model)
    assert len(result.packed) == len(graph.layers) == 2 and not result.skipped
    onnx.checker.check_model(result.model)
    onnx.shape_inference.infer_shapes(result.model, strict_mode=True)
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("Split") == 2
    assert_same_function(graph.model, result.model, graph, rtol)
    packed = load_model(FIXTURES / f"{name}.onnx", pack_projections=True)
    hidden = graph.layers[0].attention.hidden_size
    for layer in packed.layers:
        (gemm,) = qkv_ops(packed, layer.index)
        assert gemm.role == "qkv" and gemm.param("out_features") == 3 * hidden
        assert layer.attention.packed_qkv
        bias = [op for op in layer.chain if op.kind == OpKind.BIAS_ADD and op.role == "qkv"]
        assert len(bias) == (0 if name.startswith("t5") else 1)
    # inspect (and every caller that does not ask) still sees the model as exported
    assert [op.role for op in qkv_ops(graph, 0)] == ["q", "k", "v"]


def test_gpt2_is_already_packed_and_left_as_it_is():
    graph = load_model(FIXTURES / "gpt2_ts_op17.onnx")
    result = pack_projections(graph.model)
    assert result.model is graph.model and not result.packed
    assert all("already packed" in why for _, why in result.skipped) and result.skipped
    packed = load_model(FIXTURES / "gpt2_ts_op17.onnx", pack_projections=True)
    assert [op.role for op in qkv_ops(packed, 0)] == [op.role for op in qkv_ops(graph, 0)] \
        == ["qkv"]


def test_concatenation_follows_the_attention_not_graph_order(tmp_path):
    model = canonicalize(build_model(layers=1))
    q_add = node(model, "/encoder/layer.0/attention/self.query/Add")
    k_add = node(model, "/encoder/layer.0/attention/self.key/Add")
    v_add = node(model, "/encoder/layer.0/attention/self.value/Add")
    qv, kv = q_add.output[0], k_add.output[0]
    for n in model.graph.node:  # the "key" projection now feeds Q·Kᵀ's left side, "query" K
        if n.op_type == "Reshape" and n.input[0] in (qv, kv):
            n.input[0] = kv if n.input[0] == qv else qv
    path = tmp_path / "swapped.onnx"
    onnx.save(model, str(path))
    graph = load_model(path)
    block = graph.layers[0].attention
    assert block.q_input == kv and block.k_input == qv
    result = pack_projections(graph.model)
    (packed,) = result.packed
    weights = [init(model, node(model, name).input[1]) for name in (
        "/encoder/layer.0/attention/self.key/MatMul", "/encoder/layer.0/attention/self.query/MatMul",
        "/encoder/layer.0/attention/self.value/MatMul")]
    assert np.array_equal(init(result.model, packed.weight), np.concatenate(weights, axis=1))
    biases = [init(model, next(i for i in a.input if i.endswith("bias"))) for a in
              (k_add, q_add, v_add)]
    assert np.array_equal(init(result.model, str(packed.bias)), np.concatenate(biases))
    split = next(n for n in result.model.graph.node if n.op_type == "Split")
    assert list(split.output) == [kv, qv, v_add.output[0]]
    assert_same_function(graph.model, result.model, graph, 1e-6)


def test_plan_has_one_qkv_segment_of_three_hidden_per_layer(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(build_model(), str(path))
    graph = load_model(path, pack_projections=True)
    plan = build_plan(graph, None, get_profile("h100"), dtype="float16", max_seq_len=L_MAX)
    for lp in plan.layers:
        qkv = [s for s in lp.segments if set(s.roles) & {"qkv", "q", "k", "v"}]
        assert len(qkv) == 1 and qkv[0].roles == ("qkv",)
        assert qkv[0].family == "gemm" and qkv[0].dim("n0") == 3 * HIDDEN
        assert qkv[0].dim("k0") == HIDDEN


# ------------------------------------------------------------------ where it must not apply
def _value_matmul(model: onnx.ModelProto, layer: int) -> onnx.NodeProto:
    return node(model, f"/encoder/layer.{layer}/attention/self.value/MatMul")


def _different_inputs(model: onnx.ModelProto) -> str:
    mm = _value_matmul(model, 0)
    relu = helper.make_node("Relu", [mm.input[0]], ["x_relu"], name="x_relu")
    model.graph.node.insert(list(model.graph.node).index(mm), relu)
    mm.input[0] = "x_relu"
    return "different inputs"


def _different_shapes(model: onnx.ModelProto) -> str:
    mm = _value_matmul(model, 0)
    t = next(t for t in model.graph.initializer if t.name == mm.input[1])
    t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t)[None], t.name))  # [1, K, N]
    return "shapes differ"


def _read_elsewhere(model: onnx.ModelProto) -> str:
    key = node(model, "/encoder/layer.0/attention/self.key/Add").output[0]
    model.graph.node.append(helper.make_node("Relu", [key], ["key_relu"], name="key_relu"))
    model.graph.output.append(helper.make_tensor_value_info("key_relu", onnx.TensorProto.FLOAT,
                                                            None))
    return "read outside the attention block"


def _graph_output(model: onnx.ModelProto) -> str:
    key = node(model, "/encoder/layer.0/attention/self.key/Add").output[0]
    model.graph.output.append(helper.make_tensor_value_info(key, onnx.TensorProto.FLOAT, None))
    return "graph output"


def _bias_on_some(model: onnx.ModelProto) -> str:
    add = node(model, "/encoder/layer.0/attention/self.key/Add")
    matmul_out = next(i for i in add.input if "MatMul" in i)
    for n in model.graph.node:
        for i, name in enumerate(n.input):
            if name == add.output[0]:
                n.input[i] = matmul_out
    model.graph.node.remove(add)
    return "only some projections have a bias"


def _matmul_read_twice(model: onnx.ModelProto) -> str:
    add = node(model, "/encoder/layer.0/attention/self.query/Add")
    mm_out = next(i for i in add.input if "MatMul" in i)
    model.graph.node.append(helper.make_node("Relu", [mm_out], ["mm_relu"], name="mm_relu"))
    model.graph.output.append(helper.make_tensor_value_info("mm_relu", onnx.TensorProto.FLOAT,
                                                            None))
    return "read besides its bias Add"


@pytest.mark.parametrize("edit", [_different_inputs, _different_shapes, _read_elsewhere,
                                  _graph_output, _bias_on_some, _matmul_read_twice])
def test_not_packed(edit, tmp_path):
    model = build_model()
    reason = edit(model)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    graph = load_model(path)
    result = pack_projections(graph.model)
    assert len(result.packed) == 1   # layer 1 still packs
    (skip,) = result.skipped
    assert reason in skip[1], skip
    assert_same_function(graph.model, result.model, graph, 1e-6)
    untouched = {n.name for n in graph.model.graph.node if "layer.0/attention/self." in n.name
                 and n.op_type in ("MatMul", "Add")}
    assert untouched <= {n.name for n in result.model.graph.node}
    packed = load_model(path, pack_projections=True)
    assert [op.role for op in qkv_ops(packed, 1)] == ["qkv"]
    assert "qkv" not in [op.role for op in qkv_ops(packed, 0)]


# ------------------------------------------------------------------ package and compile path
@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    return build_library(tmp_path_factory.mktemp("lib"))


def _rewrite(path: Path, tmp_path: Path, *, pack_projections: bool):
    graph = load_model(path, pack_projections=pack_projections)
    _, model, emitted = rewrite_graph(graph, MASK, tmp_path, max_seq_len=L_MAX)
    return graph, model, emitted


@pytest.mark.parametrize("name", ["example", "bert_ts_op17", "bert_dynamo_op18"])
def test_package_from_packed_graph_equals_rewrite_time_packing(name, tmp_path, library):
    if name == "example":
        path = tmp_path / "m.onnx"
        onnx.save(build_model(), str(path))
    else:
        path = FIXTURES / f"{name}.onnx"
    graph, packed, emitted = _rewrite(path, tmp_path, pack_projections=True)
    _, today, _ = _rewrite(path, tmp_path, pack_projections=False)
    gemms = [n for n in packed.graph.node if n.domain == DOMAIN and n.op_type == "FusedGemm"]
    assert len(gemms) == 4 * len(graph.layers)
    dims = {t.name: list(t.dims) for t in packed.graph.initializer}
    hidden = graph.layers[0].attention.hidden_size
    for sa in (n for n in packed.graph.node if n.op_type == "SparseAttention"):
        assert list(sa.input[1:3]) == ["", ""]
        gemm = next(n for n in packed.graph.node if sa.input[0] in n.output)
        assert gemm.op_type == "FusedGemm" and dims[gemm.input[1]][-1] == 3 * hidden
        (seg,) = [e for e in emitted if gemm.name in e.nodes]
        assert seg.family == "gemm"
    feeds, _ = make_inputs(graph, 2, 19, np.random.default_rng(0))
    got, want = cpu_session(packed, library).run(None, feeds), cpu_session(today, library).run(
        None, feeds)
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a, b)


def test_compile_records_packing_and_the_packed_gemm_gets_its_tuned_rank(tmp_path):
    model = tmp_path / "m.onnx"
    onnx.save(build_model(layers=1), str(model))
    pkg = compile_model(model, "causal", max_seq_len=L_MAX, out_dir=tmp_path / "pkg",
                        instruments=Instruments(progress=False))
    doc = json.loads((pkg / "plan.json").read_text())
    assert doc["model"]["pack_projections"] is True
    plan = read_plan(pkg)
    (qkv,) = [s for s in plan.layers[0].segments if "qkv" in s.roles]
    assert qkv.dim("n0") == 3 * HIDDEN and qkv.kernel.template == "vendor/cublas"
    recompile_package(pkg, with_lt_rank(plan, 3, 256), instruments=Instruments(progress=False))
    out = onnx.load(str(pkg / "model.onnx"))
    (sa,) = [n for n in out.graph.node if n.op_type == "SparseAttention"]
    gemm = next(n for n in out.graph.node if sa.input[0] in n.output)
    attrs = {a.name: helper.get_attribute_value(a) for a in gemm.attribute}
    assert gemm.op_type == "FusedGemm" and list(sa.input[1:3]) == ["", ""]
    assert attrs["lt_algo_m"] == [256] and attrs["lt_algo_rank"] == [3]
    assert json.loads((pkg / "plan.json").read_text())["model"]["pack_projections"] is True
    segs = [s for s in json.loads((pkg / "plan.json").read_text())["segments"]
            if gemm.name in s["nodes"]]
    assert [s["ordinal"] for s in segs] == [qkv.ordinal]


def test_no_pack_qkv_keeps_three_segments(tmp_path):
    model = tmp_path / "m.onnx"
    onnx.save(build_model(layers=1), str(model))
    pkg = compile_model(model, "causal", max_seq_len=L_MAX, out_dir=tmp_path / "pkg",
                        instruments=Instruments(progress=False), pack_qkv=False)
    assert json.loads((pkg / "plan.json").read_text())["model"]["pack_projections"] is False
    roles = [r for s in read_plan(pkg).layers[0].segments for r in s.roles]
    assert {"q", "k", "v"} <= set(roles) and "qkv" not in roles
