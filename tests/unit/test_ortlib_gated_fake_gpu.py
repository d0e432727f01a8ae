"""GatedGemm's CUDA twin in ONNX Runtime without a GPU, against the recording fake driver.

The test build of ``libstofc_ort.so`` (the CUDA twins on the CPU EP) runs GatedGemm against
``cuda/ort/tests/fake_cuda.cc`` (see tests/unit/test_ortlib_fake_gpu.py): the run must ask
cuBLASLt for ``t = x @ w (+ bias)`` exactly as the vendor_glu family's executor does
(``[K, 2F]`` weight untransposed, the BIAS epilogue with a bias, one plan per M) and launch
the gated-activation kernel the package names on cuBLASLt's output, ``(t, -, y, M, F)``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from stofc.lower.twins import gated_epilogue_kernel, gated_launch_attributes
from tests.unit.test_ortlib_fake_gpu import run

K, F = 64, 96
ELEM = {"float16": (TensorProto.FLOAT16, 2), "bfloat16": (TensorProto.BFLOAT16, 14)}


def _model(tmp_path, dtype, act, bias, **override):
    kernel = gated_epilogue_kernel(act, F, dtype)
    (tmp_path / "g.cubin").write_bytes(b"fake\0")
    attrs = {**gated_launch_attributes(kernel, "g.cubin"), **override}
    elem = ELEM[dtype][0]
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((K, 2 * F)).astype(np.float32), "wf")
    b = numpy_helper.from_array(np.ones(2 * F, np.float32), "bf")
    nodes = [helper.make_node("Cast", ["x"], ["xt"], to=elem),
             helper.make_node("Cast", ["wf"], ["wt"], to=elem),
             helper.make_node("Cast", ["bf"], ["bt"], to=elem),
             helper.make_node("GatedGemm", ["xt", "wt", "bt" if bias else ""], ["yt"],
                              domain="ai.stofc", activation=act, **attrs),
             helper.make_node("Cast", ["yt"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "t", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["M", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", F])], [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.stofc", 1)])
    model.ir_version = 8
    return kernel, attrs, model


@pytest.mark.parametrize("dtype,act,bias", list(itertools.product(
    ("float16", "bfloat16"), ("silu", "gelu_erf", "gelu_tanh", "relu"), (False, True))))
def test_gated_gemm_drives_cublaslt_and_the_gated_kernel(fake, tmp_path, dtype, act, bias):
    kernel, attrs, model = _model(tmp_path, dtype, act, bias)
    feeds = [{"x": np.ones((M, K), np.float32)} for M in (33, 33, 7)]
    code, out, records = run(fake, tmp_path, model, feeds)
    assert code == 0, out
    assert [r["call"] for r in records].count("lt_create") == 1
    descs = [r for r in records if r["call"] == "lt_desc"]
    assert len(descs) == 2 and all((d["compute"], d["scale"]) == (68, 0) for d in descs)
    by_attr = {r["attr"]: r["data"] for r in records if r["call"] == "lt_desc_attr"}
    assert by_attr[3] == by_attr[4] == "00000000"         # A and B untransposed ([K, 2F] weight)
    assert int.from_bytes(bytes.fromhex(by_attr[7]), "little") == (4 if bias else 1)
    assert (8 in by_attr) == bias                         # cuBLASLt adds the bias
    code_t = ELEM[dtype][1]
    layouts = [(r["type"], r["rows"], r["cols"], r["ld"]) for r in records
               if r["call"] == "lt_layout"]
    assert layouts[:3] == [(code_t, 2 * F, K, 2 * F), (code_t, K, 33, K),
                           (code_t, 2 * F, 33, 2 * F)]
    mm = [r for r in records if r["call"] == "lt_matmul"]
    launches = [r for r in records if r["call"] == "launch"]
    assert len(mm) == len(launches) == 3
    for m, launch, M in zip(mm, launches, (33, 33, 7), strict=True):
        assert (m["alpha"], m["beta"]) == (1.0, 0.0) and m["C"] == m["D"]
        assert m["ws_size"] == 4096
        a = launch["args"]
        assert launch["fn"] == kernel.name and not kernel.problem.bias
        assert a["x"] == m["D"] and a["out"] != m["D"] and (a["M"], a["F"]) == (M, F)
        assert launch["grid"] == [-(-M // attrs["epilogue_rows"]), 1, 1]
        assert launch["block"] == [attrs["epilogue_threads"], 1, 1]


def test_a_kernel_for_another_width_fails_the_run(fake, tmp_path):
    other = gated_epilogue_kernel("silu", 2 * F, "float16")
    _, _, model = _model(tmp_path, "float16", "silu", False,
                         epilogue_kernel=f"g.cubin:{other.name}")
    code, out, records = run(fake, tmp_path, model, [{"x": np.ones((4, K), np.float32)}])
    assert code == 3 and f"compiled for rows of {2 * F} but w gives F = {F}" in out, out
    assert not [r for r in records if r["call"] == "launch"]


def test_a_kernel_for_another_activation_fails_at_session_creation(fake, tmp_path):
    _, _, model = _model(tmp_path, "float16", "silu", False,
                         epilogue_kernel=f"g.cubin:{gated_epilogue_kernel('relu', F, 'float16').name}")
    code, out, records = run(fake, tmp_path, model, [])
    assert code == 3 and "stofc GatedGemm" in out and "another activation" in out, out
    assert not [r for r in records if r["call"] == "run"]
