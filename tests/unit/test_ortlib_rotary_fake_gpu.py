"""Rotary's CUDA twin in ONNX Runtime without a GPU, against the recording fake driver.

The test build of ``libstofc_ort.so`` (the CUDA twins on the CPU EP) runs Rotary against
``cuda/ort/tests/fake_cuda.cc`` (see tests/unit/test_ortlib_fake_gpu.py): every run must make
exactly one launch of the kernel the node names, grid ``B*S`` (one block per token), the
kernel's threads, no shared memory, with the pointers of the run's tensors (packed: K and V
inside q) and the scalars :func:`stofc.kernels.rotary.rotary_launch` computes, for separate
and packed Q/K/V, every table layout and position-id form; the module is loaded once; a
kernel of the wrong dtype fails the run and a kernel that does not fit the node fails
session creation.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from stofc.kernels.rotary import RotaryConfig, RotaryProblem, kernel_name, rotary_launch
from tests.unit.test_ortlib_fake_gpu import run

H, HKV, D = 4, 2, 32
ELEM = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def _model(tmp_path, *, dtype="float16", rd=32, il=False, packed=True, positions=False,
           kernel_dtype=None, **attrs):
    problem = RotaryProblem(kernel_dtype or dtype, D, rd, il)
    name = kernel_name(problem, RotaryConfig(64))
    (tmp_path / "r.cubin").write_bytes(b"fake\0")
    elem = ELEM[dtype]
    names = ["q", "", ""] if packed else ["q", "k", "v"]
    nodes = [helper.make_node("Cast", [n], [f"{n}t"], to=elem) for n in names if n]
    ins = [f"{n}t" if n else "" for n in names] + ["cos", "sin"] + (["pos"] if positions else [])
    node_attrs = dict(num_heads=H, kv_num_heads=HKV, head_dim=D, rotary_dim=rd,
                      interleaved=int(il), kernel=f"r.cubin:{name}", kernel_abi=4) | attrs
    nodes.append(helper.make_node("Rotary", ins, ["yt"], domain="ai.stofc",
                                  **{k: v for k, v in node_attrs.items() if v is not None}))
    nodes.append(helper.make_node("Cast", ["yt"], ["y"], to=TensorProto.FLOAT))
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names if n]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("cos", "sin")]
    if positions:
        inputs.append(helper.make_tensor_value_info("pos", TensorProto.INT64, None))
    graph = helper.make_graph(nodes, "t", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.stofc", 1)])
    model.ir_version = 8
    return problem, name, model


def _feeds(B, S, packed, table, pos):
    f = {"q": np.ones((B, S, ((H + 2 * HKV) if packed else H) * D), np.float32),
         "cos": np.ones(table, np.float32), "sin": np.zeros(table, np.float32)}
    if not packed:
        f |= {"k": np.ones((B, S, HKV * D), np.float32), "v": np.ones((B, S, HKV * D), np.float32)}
    if pos is not None:
        f["pos"] = pos
    return f


CASES = [
    # packed, rotary_dim, interleaved, positions, table shape of (B, S), position ids
    (True, 32, False, False, lambda B, S: (S, 32), None),
    (False, 16, True, False, lambda B, S: (1, S, 16), None),
    (True, 32, False, False, lambda B, S: (B, S, 16), None),            # half tables
    (False, 32, False, True, lambda B, S: (40, 16), lambda B, S: np.zeros((B, S), np.int64)),
    (True, 24, True, True, lambda B, S: (40, 24), lambda B, S: np.zeros((1, S), np.int64)),
    (True, 32, False, True, lambda B, S: (40, 16), lambda B, S: np.array([3], np.int64)),
]


@pytest.mark.parametrize("packed,rd,il,positions,table,pos", CASES)
def test_one_launch_per_run_with_the_documented_arguments(fake, tmp_path, packed, rd, il,
                                                          positions, table, pos):
    problem, name, model = _model(tmp_path, rd=rd, il=il, packed=packed, positions=positions)
    shapes = [(2, 5), (2, 5), (3, 1)]
    feeds = [_feeds(B, S, packed, table(B, S), pos(B, S) if pos else None) for B, S in shapes]
    code, out, records = run(fake, tmp_path, model, feeds)
    assert code == 0, out
    assert [r["call"] for r in records].count("module_load") == 1
    launches = [r for r in records if r["call"] == "launch"]
    assert len(launches) == len(shapes)
    for (B, S), launch in zip(shapes, launches, strict=True):
        want = rotary_launch(problem, RotaryConfig(64), batch=B, seq=S, heads=H, kv_heads=HKV,
                             packed=packed, table_shape=table(B, S),
                             position_shape=pos(B, S).shape if pos else None)
        assert launch["fn"] == name
        assert launch["grid"] == [want.grid, 1, 1] == [B * S, 1, 1]
        assert launch["block"] == [64, 1, 1] and launch["smem"] == 0
        args = launch["args"]
        assert {n: args[n] for n, _ in want.scalars} == dict(want.scalars)
        if packed:   # K and V inside q, in bytes of 2-byte elements
            assert args["k"] == args["q"] + 2 * want.k_offset == args["q"] + 2 * H * D
            assert args["v"] == args["q"] + 2 * want.v_offset == args["q"] + 2 * (H + HKV) * D
        else:
            assert len({args["q"], args["k"], args["v"]}) == 3
        assert len({args["out"], args["q"], args["cos"], args["sin"]}) == 4


def test_a_kernel_of_another_dtype_fails_the_run(fake, tmp_path):
    _, _, model = _model(tmp_path, dtype="float16", kernel_dtype="bfloat16")
    code, out, _ = run(fake, tmp_path, model, [_feeds(1, 3, True, (3, 32), None)])
    assert code == 3 and "is compiled for bfloat16 but the node's data is float16" in out


@pytest.mark.parametrize("attrs,message", [
    ({"kernel_abi": None}, "carries no CUDA launch attributes"),
    ({"kernel": None}, "attribute 'kernel' (FILE.cubin:ENTRY of the rotary kernel) is required"),
    ({"rotary_dim": 16}, "compiled for head_dim 32, rotary_dim 32, rh but the node has"),
    ({"kernel": "missing.cubin:stofc_rotary_float16_d32_r32_rh_v8_t64"}, "missing.cubin"),
])
def test_bad_kernel_attributes_fail_session_creation(fake, tmp_path, attrs, message):
    _, _, model = _model(tmp_path, **attrs)
    code, out, records = run(fake, tmp_path, model, [_feeds(1, 3, True, (3, 32), None)])
    assert code == 3 and message in out, out
    assert not [r for r in records if r["call"] == "run"]
