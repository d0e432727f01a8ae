"""Each chain op's description (kind, params, inputs, outputs) recomputes what the graph computes.

ONNX Runtime runs the canonicalized model with every chain op's inputs and
outputs exposed; numpy recomputes each op from its inputs and its params only
(weight + layout, fused bias, norm scale/bias/epsilon, GELU approximation, a gated
FFN's act(gate) * up) and
must match. This pins the contract the plan and the kernels rely on.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from graphs import build

from stofc.frontend import OpKind, load_model
from tests.unit.test_frontend_semantics import _feeds, _run

pytest.importorskip("onnxruntime")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())


def _main_output(graph, op) -> str:
    last = next(n for n in graph.model.graph.node if n.name == op.nodes[-1])
    produced = [o for o in op.outputs if o in last.output]
    return produced[0] if produced else op.outputs[-1]


def _erf(x):
    return np.vectorize(math.erf)(x)


def _compute(op, x: list[np.ndarray], w: dict[str, np.ndarray], pending: dict) -> np.ndarray | None:
    kind, p = op.kind, op.param
    if kind == OpKind.GEMM:
        weight = w[p("weight")]
        weight = weight if p("weight_layout") == "KN" else weight.T
        assert weight.shape == (p("in_features"), p("out_features"))
        y = x[0].reshape(-1, weight.shape[0]) @ weight
        if p("fused_bias"):
            pending["gemm"] = y  # the bias_add that follows owns the output
            return None
        return y
    if kind == OpKind.BIAS_ADD:
        base = pending.pop("gemm") if not op.inputs else x[0].reshape(-1, x[0].shape[-1])
        return base + w[p("bias")]
    if kind == OpKind.RESIDUAL_ADD:
        return x[0] + x[1]
    if kind in (OpKind.LAYERNORM, OpKind.RMSNORM):
        v = x[0]
        if kind == OpKind.LAYERNORM:
            v = v - v.mean(-1, keepdims=True)
        y = v / np.sqrt((v * v).mean(-1, keepdims=True) + p("epsilon"))
        y = y * w[p("scale")] if p("scale") else y
        return y + w[p("bias")] if kind == OpKind.LAYERNORM and p("bias") else y
    if kind == OpKind.GELU:
        v = x[0]
        if p("approximation") == "tanh":
            return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))
        return 0.5 * v * (1 + _erf(v / math.sqrt(2)))
    if kind == OpKind.ACTIVATION:
        v = x[0]
        return {"Relu": lambda: np.maximum(v, 0), "Silu": lambda: v / (1 + np.exp(-v)),
                "QuickGelu": lambda: v / (1 + np.exp(-1.702 * v))}[p("op")]()
    if kind == OpKind.GATED:
        v, f = x[0], p("features")
        gate, up = v[..., :f], v[..., f:]
        act = {"silu": lambda a: a / (1 + np.exp(-a)), "relu": lambda a: np.maximum(a, 0),
               "gelu_erf": lambda a: 0.5 * a * (1 + _erf(a / math.sqrt(2))),
               "gelu_tanh": lambda a: 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) *
                                                             (a + 0.044715 * a**3)))}
        assert v.shape[-1] == 2 * f
        return act[p("act")](gate) * up
    return None  # attention: checked by test_frontend_semantics


def _check(graph, rtol):
    weights = {t.name: numpy_helper.to_array(t).astype(np.float64)
               for t in graph.model.graph.initializer}
    names = [v for layer in graph.layers for op in layer.chain if op.kind != OpKind.ATTENTION
             for v in (*op.inputs, *op.outputs)]
    values = _run(graph.model, list(dict.fromkeys(names)), _feeds(graph, np.random.default_rng(1)))
    checked = 0
    for layer in graph.layers:
        pending: dict = {}
        for op in layer.chain:
            if op.kind == OpKind.ATTENTION:
                continue
            got = _compute(op, [values[i].astype(np.float64) for i in op.inputs], weights,
                           pending)
            if got is None:
                continue
            want = values[_main_output(graph, op)].astype(np.float64)
            scale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(got.reshape(want.shape), want, rtol=rtol,
                                       atol=rtol * scale, err_msg=f"{op.kind.value} {op.role}")
            checked += 1
    if graph.unsupported:  # chains that stop (RoPE projections, gated FFN left to ORT):
        assert checked >= len(graph.layers)  # at least every output projection
    else:
        assert checked >= 10 * len(graph.layers) - 2 * len(graph.layers)


@pytest.mark.parametrize("name", sorted(e["file"] for e in MANIFEST["fixtures"]))
def test_fixture_chain_recomputes(name):
    entry = next(e for e in MANIFEST["fixtures"] if e["file"] == name)
    _check(load_model(FIXTURES / name), rtol=3e-2 if entry.get("dtype") == "float16" else 1e-4)


@pytest.mark.parametrize("variant", [
    {"qkv": "gemm"}, {"norm": "ln_decomposed"}, {"norm": "rms_op"},
    {"norm": "rms_decomposed", "bias": False, "order": "pre", "act": "relu"},
    {"act": "tanh"}, {"act": "gelu_op"}, {"order": "pre", "qkv": "fused_split"},
    {"glu": "separate", "act": "silu", "order": "pre", "bias": False},
    {"glu": "split", "act": "erf"}, {"glu": "slice", "act": "tanh", "order": "pre"},
    {"glu": "separate", "act": "relu", "norm": "rms_decomposed"},
])
def test_variant_chain_recomputes(tmp_path, variant):
    path = tmp_path / "m.onnx"
    onnx.save(build(layers=[variant, variant]), str(path))
    _check(load_model(path), rtol=1e-4)
