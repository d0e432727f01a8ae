"""Q, K, V packing in the package rewrite: one [K, 3N] FusedGemm per layer feeding a packed q.

``rewrite_model(pack_qkv=True)`` (the default) turns a layer's three Q, K, V
FusedGemm nodes into one whose weight is [Wq | Wk | Wv] and bias [bq | bk | bv]
(a missing bias is zeros), read by SparseAttention as its packed ``q`` with
``k`` and ``v`` omitted (OPS.md, packed QKV). Checked here: the structure, the
packed weights against the three unpacked ones bit for bit, the plan.json
record, the CUDA launch attributes of the packed node, the cases that must not
pack, and the CPU twins: the packed package equals the unpacked one exactly
(the CPU FusedGemm computes each output column on its own, and the packed
SparseAttention is bit-equal to separate q, k, v) and matches the masked
reference within the bound the other package tests use.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from stofc.frontend import load_model
from stofc.lower.emit import tensor_bits
from stofc.lower.rewrite import DOMAIN
from stofc.lower.twins import KERNEL_ABI
from stofc.package.ortlib import build_library
from stofc.package.reference import inject_mask
from stofc.package.verify import compare, make_inputs, verify_package
from stofc.pipeline import Instruments, compile_model
from tests.unit.rewrite_helpers import cpu_session, rewrite_graph

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
import graphs  # noqa: E402
from build_model import build_model  # noqa: E402

MASK = "bigbird:block=16,window=3,global=1,random=1,seed=0"
L_MAX = 128


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    return build_library(tmp_path_factory.mktemp("lib"))


def rewrite(model: onnx.ModelProto, tmp_path: Path, *, pack_qkv: bool = True,
            dtype: str = "float16"):
    """(graph, formats, rewritten model, emitted segments) of ``model`` on the mask."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    graph = load_model(path)
    formats, model, emitted = rewrite_graph(graph, MASK, tmp_path, max_seq_len=L_MAX,
                                            dtype=dtype, pack_qkv=pack_qkv)
    return graph, formats, model, emitted


def stofc_nodes(model: onnx.ModelProto, op: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == op]


def inits(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def producer(model: onnx.ModelProto, value: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if value in n.output)


def without_key_bias(model: onnx.ModelProto, layer: int) -> onnx.ModelProto:
    """``model`` with layer ``layer``'s K projection computed without its bias Add."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    add = next(n for n in out.graph.node
               if n.name.startswith(f"/encoder/layer.{layer}/attention/self.key/Add"))
    produced = {o for n in out.graph.node for o in n.output}
    matmul_out = next(i for i in add.input if i in produced)
    for node in out.graph.node:
        for i, name in enumerate(node.input):
            if name == add.output[0]:
                node.input[i] = matmul_out
    out.graph.node.remove(add)
    return out


def test_one_packed_gemm_per_layer_with_the_concatenated_weights(tmp_path):
    _, _, packed, emitted = rewrite(build_model(), tmp_path / "p")
    _, _, plain, _ = rewrite(build_model(), tmp_path / "u", pack_qkv=False)
    assert len(stofc_nodes(packed, "FusedGemm")) == 8 and len(stofc_nodes(plain, "FusedGemm")) == 12
    w_packed, w_plain = inits(packed), inits(plain)
    for sa, sa_plain in zip(stofc_nodes(packed, "SparseAttention"),
                            stofc_nodes(plain, "SparseAttention"), strict=True):
        assert list(sa.input[1:3]) == ["", ""] and sa.input[0]
        gemm = producer(packed, sa.input[0])
        assert gemm.domain == DOMAIN and gemm.op_type == "FusedGemm"
        assert [n for n in packed.graph.node if sa.input[0] in n.input] == [sa]
        parts = [producer(plain, v) for v in sa_plain.input[:3]]
        assert all(p.op_type == "FusedGemm" for p in parts)
        assert gemm.input[0] == parts[0].input[0]  # the same x
        w = tensor_bits(w_packed[gemm.input[1]])
        want = [tensor_bits(w_plain[p.input[1]]) for p in parts]
        assert w.shape == (128, 384) and np.array_equal(w, np.concatenate(want, axis=1))
        b = tensor_bits(w_packed[gemm.input[2]])
        assert np.array_equal(b, np.concatenate([tensor_bits(w_plain[p.input[2]]) for p in parts]))
        assert w_packed[gemm.input[1]].data_type == onnx.TensorProto.FLOAT16
        # the three per-projection weights are gone from the packed model
        assert not {p.input[1] for p in parts} & set(w_packed)
    # plan.json's record: the three GEMM segments name the packed node, and say so
    by_layer: dict[int, list] = {}
    for e in emitted:
        by_layer.setdefault(e.layer, []).append(e)
    names = {n.name for n in stofc_nodes(packed, "FusedGemm")}
    for segs in by_layer.values():
        qkv = [s for s in segs if s.ordinal in (0, 1, 2)]
        shared = set.intersection(*(set(s.nodes) & names for s in qkv))
        assert len(shared) == 1 and all("Q|K|V packed" in s.note for s in qkv), qkv
        attn = next(s for s in segs if s.family == "attention")
        assert shared.pop() in attn.note and "k, v omitted" in attn.note
        assert all(e.ops for e in segs)


def test_escape_hatch_keeps_three_gemms(tmp_path):
    _, _, plain, emitted = rewrite(build_model(), tmp_path, pack_qkv=False)
    for sa in stofc_nodes(plain, "SparseAttention"):
        assert all(sa.input[:3]) and len(set(sa.input[:3])) == 3
        assert all(producer(plain, v).op_type == "FusedGemm" for v in sa.input[:3])
    assert not any("packed" in e.note for e in emitted)


def test_packed_package_equals_unpacked_and_matches_reference(tmp_path, library):
    model = without_key_bias(build_model(), 1)  # layer 1: bias [bq | 0 | bv]
    graph, formats, packed, _ = rewrite(model, tmp_path / "p")
    _, _, plain, _ = rewrite(model, tmp_path / "u", pack_qkv=False)
    gemm = producer(packed, stofc_nodes(packed, "SparseAttention")[1].input[0])
    bias = tensor_bits(inits(packed)[gemm.input[2]])
    assert bias.shape == (384,) and not bias[128:256].any() and bias[:128].any()
    assert [t.name for t in packed.graph.input] == [t.name for t in model.graph.input]
    assert [(o.name, o.type) for o in packed.graph.output] == \
        [(o.name, o.type) for o in model.graph.output]
    ref = ort.InferenceSession(inject_mask(graph, formats).SerializeToString(),
                               providers=["CPUExecutionProvider"])
    pkg, unpacked = cpu_session(packed, library), cpu_session(plain, library)
    rng = np.random.default_rng(3)
    for batch, seq in ((2, L_MAX), (3, 45)):
        feeds, real = make_inputs(graph, batch, seq, rng)
        out, want = pkg.run(None, feeds)[0], ref.run(None, feeds)[0]
        assert np.array_equal(out, unpacked.run(None, feeds)[0])
        err, scale, n = compare(out, want, real)
        assert n > 0 and err / scale <= 1e-2, (err, scale)


def test_frontend_packed_qkv_feeds_q_without_split(tmp_path, library):
    model = graphs.build(layers=({}, {}), qkv="fused_split")
    graph, formats, packed, emitted = rewrite(model, tmp_path / "p")
    assert not any(n.op_type == "Split" for n in packed.graph.node)
    for sa in stofc_nodes(packed, "SparseAttention"):
        assert list(sa.input[1:3]) == ["", ""]
    assert all("k, v omitted" in e.note for e in emitted if e.family == "attention")
    _, _, plain, _ = rewrite(model, tmp_path / "u", pack_qkv=False)
    assert sum(n.op_type == "Split" for n in plain.graph.node) == 2
    feeds, real = make_inputs(graph, 2, 40, np.random.default_rng(0))
    out = cpu_session(packed, library).run(None, feeds)[0]
    assert np.array_equal(out, cpu_session(plain, library).run(None, feeds)[0])
    want = ort.InferenceSession(inject_mask(graph, formats).SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    err, scale, n = compare(out, want, real)
    assert n > 0 and err / scale <= 1e-2


def test_no_bias_anywhere_gives_a_packed_gemm_without_bias(tmp_path):
    _, _, packed, _ = rewrite(graphs.build(layers=({},), bias=False), tmp_path)
    sa = stofc_nodes(packed, "SparseAttention")[0]
    gemm = producer(packed, sa.input[0])
    assert gemm.op_type == "FusedGemm" and len(gemm.input) == 2
    assert list(inits(packed)[gemm.input[1]].dims) == [64, 192]


def test_bfloat16_weights_are_packed_bit_for_bit(tmp_path):
    _, _, packed, _ = rewrite(build_model(layers=1), tmp_path / "p", dtype="bfloat16")
    _, _, plain, _ = rewrite(build_model(layers=1), tmp_path / "u", dtype="bfloat16",
                             pack_qkv=False)
    sa, sa_plain = stofc_nodes(packed, "SparseAttention")[0], stofc_nodes(plain, "SparseAttention")[0]
    gemm = producer(packed, sa.input[0])
    w = inits(packed)[gemm.input[1]]
    assert w.data_type == onnx.TensorProto.BFLOAT16
    parts = [inits(plain)[producer(plain, v).input[1]] for v in sa_plain.input[:3]]
    assert np.array_equal(tensor_bits(w), np.concatenate([tensor_bits(p) for p in parts], axis=1))


def test_a_projection_read_elsewhere_is_not_packed(tmp_path):
    model = build_model()
    key = next(n for n in model.graph.node
               if n.name.startswith("/encoder/layer.0/attention/self.key/Add")).output[0]
    model.graph.output.append(helper.make_tensor_value_info(key, onnx.TensorProto.FLOAT, None))
    _, _, packed, emitted = rewrite(model, tmp_path)
    first, second = stofc_nodes(packed, "SparseAttention")
    assert all(first.input[:3]) and list(second.input[1:3]) == ["", ""]
    assert [o.name for o in packed.graph.output] == [o.name for o in model.graph.output]
    assert not any("packed" in e.note for e in emitted if e.layer == 0)


def test_compiled_package_launches_the_packed_gemm(tmp_path):
    """compile_model packs by default; the packed node's CUDA attributes (width 3N, bias)."""
    quiet = Instruments(progress=False)
    example = tmp_path / "model.onnx"
    onnx.save(build_model(), str(example))
    pkg = compile_model(example, MASK, max_seq_len=L_MAX, out_dir=tmp_path / "pkg",
                        instruments=quiet)
    model = onnx.load(str(pkg / "model.onnx"))
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    doc = json.loads((pkg / "plan.json").read_text())
    for sa in stofc_nodes(model, "SparseAttention"):
        gemm = producer(model, sa.input[0])
        attrs = {a.name: helper.get_attribute_value(a) for a in gemm.attribute}
        assert dims[gemm.input[1]] == [128, 384] and dims[gemm.input[2]] == [384]
        assert attrs["kernel_abi"] == KERNEL_ABI and attrs["epilogue_kernel"] == b""
        assert attrs["activation"] == b"none" and len(gemm.input) == 3
        holders = [s for s in doc["segments"] if gemm.name in s["nodes"]]
        # compile packs the projections in the graph (stofc.frontend.pack): one qkv segment
        assert [s["ordinal"] for s in holders] == [0] and holders[0]["family"] == "gemm"
    assert verify_package(pkg, cases=[(2, L_MAX), (1, 57)]).passed
