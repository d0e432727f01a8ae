"""Plans of the real exported models (tests/fixtures) against ONNX Runtime (CPU).

For one export of every architecture, ONNX Runtime runs the canonicalized model
with every chain value as an extra output. Then (a) the float64 operator-by-
operator evaluation of the frontend's chain (``reference_chain``) and (b) every
segment of several fusion schemes, evaluated from its bindings and epilogues
(``reference_segment``: exactly what the kernels and the runner execute), must
reproduce ONNX Runtime's values. This checks the dataflow, the family mapping
and the parameter interpretation (weight layouts, fused Gemm biases, GELU forms,
epsilons, residual operand order) on graphs the exporters really produce.
Tolerance: ORT computes in float32: relative (Frobenius) errors of float32
dot products over K <= 96 are about ``sqrt(K) * 2^-24`` (6e-7; observed at most
2.2e-7), so ``2e-6`` keeps a margin of ~3 and still catches e.g. the tanh GELU
in place of the erf form (a mutation test run by hand failed every GELU layer).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from stofc.frontend import load_model
from stofc.frontend.types import OpKind
from stofc.plan.dataflow import resolve_dataflow
from stofc.plan.families import match_segments
from stofc.plan.moves import initial_scheme
from stofc.plan.reference import reference_chain, reference_segment
from stofc.plan.scheme import FusionScheme

ort = pytest.importorskip("onnxruntime")

FIXTURES = ["bert_ts_op17", "bert_dynamo_op20", "distilbert_dynamo_op18", "electra_ts_op17",
            "roberta_dynamo_op20", "gpt2_dynamo_op20", "gpt2_ts_op17", "t5_ts_op17",
            "t5_dynamo_op20", "vit_dynamo_op18", "llama_ts_op17", "qwen2_dynamo_op18",
            "mistral_optimum_op18", "gemma2_ts_op17_eager"]
TOL = 2e-6


def _feeds(graph, rng):
    feeds = {}
    for info in graph.inputs:
        shape = [d if isinstance(d, int) else (2 if i == 0 else 8)
                 for i, d in enumerate(info.shape)]
        if info.dtype == "int64":
            arr = rng.integers(0, 20, size=shape).astype(np.int64)
            if "mask" in info.name:
                arr = np.ones(shape, dtype=np.int64)
            feeds[info.name] = arr
        else:
            feeds[info.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _run_with_values(graph, names, feeds):
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    have = {o.name for o in model.graph.output}
    for name in names:
        if name not in have:
            model.graph.output.append(onnx.ValueInfoProto(name=name))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    wanted = [o.name for o in sess.get_outputs()]
    outs = sess.run(wanted, feeds)
    return dict(zip(wanted, outs, strict=True))


def _weights(graph):
    return {init.name: numpy_helper.to_array(init).astype(np.float64)
            for init in graph.model.graph.initializer}


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module", params=FIXTURES)
def traced(request):
    graph = load_model(f"tests/fixtures/{request.param}.onnx")
    layer = graph.layers[0]
    flows = resolve_dataflow(layer)
    real = {n for node in graph.model.graph.node for n in node.output}
    names = sorted({v for f in flows for v in (*f.inputs, f.output) if v in real})
    values = _run_with_values(graph, names, _feeds(graph, np.random.default_rng(0)))
    hidden = layer.attention.hidden_size
    flat = {k: v.reshape(-1, v.shape[-1]).astype(np.float64) for k, v in values.items()
            if v.ndim >= 2 and v.shape[-1] in _widths(layer, hidden)}
    return request.param, graph, layer, flat


def _widths(layer, hidden):
    return {hidden, *(int(op.param("out_features")) for op in layer.chain
                      if op.kind == OpKind.GEMM)}


def test_chain_reference_reproduces_onnxruntime(traced):
    name, graph, layer, values = traced
    flows = resolve_dataflow(layer)
    att = next(f for f in flows if f.kind == OpKind.ATTENTION)
    start = flows[0].inputs[0]
    env = reference_chain(layer, {start: values[start]}, _weights(graph),
                          lambda ins: values[att.output])
    checked = 0
    for flow in flows:
        if flow.output in values and flow.kind != OpKind.ATTENTION:
            assert _rel(env[flow.output], values[flow.output]) < TOL, (name, flow)
            checked += 1
    assert checked >= 6


@pytest.mark.parametrize("kind", ["initial", "unfused", "ffn_chain", "no_norm_fusion"])
def test_segments_reproduce_onnxruntime(traced, kind):
    name, graph, layer, values = traced
    n = len(layer.chain)
    scheme = {"initial": lambda: initial_scheme(layer, tokens=4096),
              "unfused": lambda: FusionScheme.unfused(n),
              "ffn_chain": lambda: initial_scheme(layer, tokens=16, ffn_chain_max_tokens=64),
              "no_norm_fusion": lambda: initial_scheme(layer, tokens=16,
                                                       norm_fusion_min_tokens=10**9)}[kind]()
    weights = _weights(graph)
    env = dict(values)
    flows = resolve_dataflow(layer)
    att = next(f for f in flows if f.kind == OpKind.ATTENTION)
    checked = 0
    for seg in match_segments(layer, scheme):
        if seg.family == "attention":
            env[att.output] = values[att.output]
            continue
        outs = reference_segment(layer, seg, env, weights)
        for value, got in outs.items():
            if value in values:
                assert _rel(got, values[value]) < TOL, (name, kind, seg.family, value)
                checked += 1
        env.update(outs)  # virtual values (a split fused-bias Gemm) flow on
    assert checked >= 3
