"""Real exported layers (tests/fixtures) through the CuPy runner vs ONNX Runtime.

The first layer of each model runs through the segment runner (fp16, real
weights; attention output taken from ONNX Runtime), for the default plan (vendor
GEMMs) and the hand-written-template plan; every value the segments store must
match ONNX Runtime's float32 value within the fp16 bound of downstream_cases
(``2 r u + sqrt(K) 2^-22``, r = stored roundings on the path).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from stofc.frontend import load_model
from stofc.frontend.types import OpKind
from stofc.plan.build import build_plan, plan_layer
from stofc.plan.dataflow import resolve_dataflow
from stofc.plan.moves import initial_scheme
from stofc.runtime.segments import SegmentRunner, from_bits, to_bits, to_device, to_host
from stofc.targets import get_profile
from tests.gpu.downstream_cases import UNIT, _depths
from tests.unit.test_plan_fixtures import _feeds, _run_with_values, _weights, _widths

ort = pytest.importorskip("onnxruntime")
FIXTURES = ["bert_ts_op17", "gpt2_dynamo_op20", "t5_ts_op17", "vit_dynamo_op18",
            "distilbert_dynamo_op18"]


@pytest.mark.parametrize("plan_kind", ["default", "template"])
@pytest.mark.parametrize("fixture", FIXTURES)
def test_fixture_layer_through_runner(fixture, plan_kind):
    import cupy

    graph = load_model(f"tests/fixtures/{fixture}.onnx")
    layer = graph.layers[0]
    flows = resolve_dataflow(layer)
    real = {n for node in graph.model.graph.node for n in node.output}
    names = sorted({v for f in flows for v in (*f.inputs, f.output) if v in real})
    raw = _run_with_values(graph, names, _feeds(graph, np.random.default_rng(1)))
    widths = _widths(layer, layer.attention.hidden_size)
    values = {k: v.reshape(-1, v.shape[-1]).astype(np.float32) for k, v in raw.items()
              if v.ndim >= 2 and v.shape[-1] in widths}
    start = flows[0].inputs[0]
    att = next(f for f in flows if f.kind == OpKind.ATTENTION)
    tokens = values[start].shape[0]
    profile = get_profile("h100")
    if plan_kind == "default":
        plan = build_plan([layer], None, profile, dtype="float16", max_seq_len=tokens).layers[0]
    else:
        plan = plan_layer(layer, initial_scheme(layer, tokens=4096), tokens=tokens,
                          profile=profile, dtype="float16")
    weights = {k: from_bits(to_bits(v, "float16"), "float16") for k, v in
               _weights(graph).items() if v.ndim >= 1}
    runner = SegmentRunner(layer, plan, weights, dtype="float16")
    runner.poison = True
    env = {start: to_device(values[start], "float16")}
    a_dev = to_device(values[att.output], "float16")
    runner.run_chain(env, batch=1, seq_len=tokens, attention=lambda seg, vals: a_dev)
    cupy.cuda.runtime.deviceSynchronize()
    depth = _depths(layer)
    k_max = max(int(op.param("in_features")) for op in layer.chain if op.kind == OpKind.GEMM)
    checked = 0
    for seg in plan.segments:
        for name in seg.outputs:
            if seg.family == "attention" or name not in values:
                continue
            got = to_host(env[name], "float16")
            assert np.isfinite(got).all(), (fixture, name, "unwritten or non-finite")
            want = values[name]
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            # the layer input and attention output are rounded too: one more rounding
            bound = 2 * (depth[name] + 1) * UNIT["float16"] + math.sqrt(k_max) * 2.0**-22
            assert err <= bound, (fixture, plan_kind, seg.family, name, err, bound)
            checked += 1
    assert checked >= 3
