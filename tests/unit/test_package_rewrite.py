"""The ai.stofc rewrite on every layer pattern the frontend handles (CPU twins vs reference).

Each variant of ``tests/fixtures/graphs.py`` is planned, rewritten to ai.stofc
ops, run by ONNX Runtime's CPU EP with the custom-op library, and compared
with the original graph with the structured mask injected. No kernels are
needed on the CPU, so the graphs' small head_dim (16) does not matter here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from stofc.errors import PlanError
from stofc.frontend import load_model
from stofc.frontend.types import OpKind
from stofc.lower.rewrite import DOMAIN
from stofc.package.ortlib import build_library
from stofc.package.reference import inject_mask
from stofc.package.verify import compare, make_inputs
from stofc.plan.attention import attention_inputs
from tests.unit.rewrite_helpers import cpu_session, rewrite_graph

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
import graphs  # noqa: E402

MASK = "sliding:window=6"
L_MAX = 48


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    return build_library(tmp_path_factory.mktemp("lib"))


def rewrite_and_compare(model: onnx.ModelProto, tmp_path: Path, library: Path,
                        dtype: str = "float16", unfused: bool = False
                        ) -> tuple[onnx.ModelProto, list]:
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    graph = load_model(path)
    assert graph.layers, "the frontend found no layer"
    formats, rewritten, emitted = rewrite_graph(graph, MASK, tmp_path, max_seq_len=L_MAX,
                                                dtype=dtype, causal_from_graph=True,
                                                unfused=unfused)
    pkg = cpu_session(rewritten, library)
    ref = ort.InferenceSession(inject_mask(graph, formats).SerializeToString(),
                               providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    names = [o.name for o in ref.get_outputs()]
    for batch, seq in ((2, L_MAX), (3, 21)):
        feeds, real = make_inputs(graph, batch, seq, rng)
        for out, want in zip(pkg.run(names, feeds), ref.run(names, feeds), strict=True):
            err, scale, n = compare(out, want, real)
            assert n > 0 and err / scale <= 1e-2, (err, scale)
    return rewritten, list(emitted)


VARIANTS = {
    "bert-separate": {},
    "fused_split": {"qkv": "fused_split"},
    "gemm_transB": {"qkv": "gemm"},
    "fused_gather": {"qkv": "fused_gather"},
    "k_transpose_after": {"k_layout": "transpose_after", "scale": "mul"},
    "split_qk_scale": {"scale": "split_qk"},
    "where_bool_mask": {"mask": "where_bool"},
    "no_mask": {"mask": "none"},
    "causal_in_graph": {"mask": "causal", "order": "pre"},
    "t5_bias": {"mask": "t5_bias_mask", "norm": "rms_decomposed", "order": "pre",
                "scale": "none", "bias": False, "act": "relu"},
    "guarded_softmax": {"guard": True},
    "ln_decomposed_tanh": {"norm": "ln_decomposed", "act": "tanh"},
    "pre_ln_gelu_op": {"order": "pre", "act": "gelu_op"},
    "attention_op": {"attention_op": True, "mask": "none"},
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_rewrite_variant(name, tmp_path, library):
    model = graphs.build(layers=({}, {}), **VARIANTS[name])
    rewritten, emitted = rewrite_and_compare(model, tmp_path, library)
    ops = [n.op_type for n in rewritten.graph.node if n.domain == DOMAIN]
    assert ops.count("SparseAttention") == 2
    assert not any(n.op_type == "Softmax" for n in rewritten.graph.node)
    assert all(e.ops for e in emitted)


def test_relu_is_recorded_as_onnx_ops(tmp_path, library):
    model = graphs.build(layers=({},), act="relu")
    _, emitted = rewrite_and_compare(model, tmp_path, library)
    relu = [e for e in emitted if "onnx:Relu" in e.ops]
    assert relu and all("ai.stofc:FusedGemm" in e.ops and e.note for e in relu)


def test_mixed_layer_variants(tmp_path, library):
    model = graphs.build(layers=({"qkv": "gemm"}, {"qkv": "fused_split", "act": "tanh"},
                                 {"norm": "ln_decomposed"}))
    rewritten, _ = rewrite_and_compare(model, tmp_path, library)
    assert [n.op_type for n in rewritten.graph.node].count("Softmax") == 0


def test_unsupported_mask_form_is_a_plan_error(tmp_path):
    model = graphs.build(layers=({"mask": "additive"},))
    # make the padding mask a float [B, 1, 1, S] input: not a [B, S] padding input
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    graph = load_model(path)
    block = graph.layers[0].attention
    fake = type(graph)(**{**graph.__dict__, "inputs": tuple(
        type(v)(v.name, v.dtype, (*v.shape, 1)) if v.name == block.mask_source else v
        for v in graph.inputs)})
    with pytest.raises(PlanError, match="padding input"):
        attention_inputs(block, fake.inputs)


@pytest.mark.parametrize("order", ["pre", "post"])
def test_onnxruntime_simplified_layernorm_is_an_rmsnorm_segment(order, tmp_path, library):
    """ONNX Runtime's own RMSNorm op (SimplifiedLayerNormalization, as its transformer
    optimizer writes it) is a chain rmsnorm: every one of them becomes an AddLayerNorm in RMS
    mode (with the residual Add before it in one pass where the plan fuses it), none is left
    to ONNX Runtime, and the package matches the original."""
    model = graphs.build(layers=({}, {}), norm="rms_ort", order=order, bias=False)
    path = tmp_path / "src.onnx"
    onnx.save(model, str(path))
    graph = load_model(path)
    norms = [o for layer in graph.layers for o in layer.chain if o.kind == OpKind.RMSNORM]
    assert len(norms) == 4
    assert all(o.param("form") == "op" and o.param("epsilon") == pytest.approx(1e-6)
               for o in norms)
    rewritten, _ = rewrite_and_compare(model, tmp_path, library)
    assert not any(n.op_type == "SimplifiedLayerNormalization" for n in rewritten.graph.node)
    rms = [n for n in rewritten.graph.node if n.domain == DOMAIN and n.op_type == "AddLayerNorm"]
    assert rms and all(any(a.name == "rms" and a.i == 1 for a in n.attribute) for n in rms)


@pytest.mark.parametrize("norm", ["rms_ort", "ln_op"])
@pytest.mark.parametrize("order", ["pre", "post"])
def test_onnxruntime_skip_layernorm_is_a_residual_add_and_a_norm(norm, order, tmp_path,
                                                                 library):
    """ONNX Runtime's residual Add + norm in one node (SkipSimplifiedLayerNormalization /
    SkipLayerNormalization, com.microsoft): a residual_add and a norm chain op sharing the
    node, the sum read as its output 3 (pre-norm: the stream) or a plan-internal value
    (post-norm: nobody reads it). No Skip node is left to ONNX Runtime; the package matches."""
    model = graphs.build(layers=({}, {}), norm=norm, order=order, bias=False, skip_norm=True)
    path = tmp_path / "src.onnx"
    onnx.save(model, str(path))
    graph = load_model(path)
    assert not graph.unsupported
    for layer in graph.layers:
        kinds = [o.kind for o in layer.chain]
        at = kinds.index(OpKind.RESIDUAL_ADD)
        add, normed = layer.chain[at], layer.chain[at + 1]
        assert normed.kind == (OpKind.RMSNORM if norm == "rms_ort" else OpKind.LAYERNORM)
        assert add.nodes == normed.nodes and "Skip" in add.nodes[0]
        assert bool(add.outputs) == (order == "pre")
    rewritten, _ = rewrite_and_compare(model, tmp_path, library)
    assert not any("Skip" in n.op_type for n in rewritten.graph.node)
    assert sum(n.op_type == "AddLayerNorm" for n in rewritten.graph.node) >= 2


@pytest.mark.parametrize("order", ["pre", "post"])
def test_a_skip_layernorm_split_over_two_segments(order, tmp_path, library):
    """The residual_add and the norm of one Skip node in different segments (the unfused
    plan): the sum flows between them (post-norm: a value the model never had)."""
    model = graphs.build(layers=({}, {}), norm="rms_ort", order=order, bias=False,
                         skip_norm=True)
    rewritten, emitted = rewrite_and_compare(model, tmp_path, library, unfused=True)
    assert not any("Skip" in n.op_type for n in rewritten.graph.node)
    graph = load_model(tmp_path / "model.onnx")          # the source, as rewrite_and_compare saved it
    assert len(emitted) == sum(len(layer.chain) for layer in graph.layers)  # one op a segment
