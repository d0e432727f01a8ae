"""The embedding in the package dtype (:mod:`stofc.lower.embed`).

Checked here on the exporter fixtures (head_dim 16: rewrite only, CPU twins): HF
BERT and GPT-2 (TorchScript and dynamo) and T5 gather from float16 tables and
write the first fused op's input directly (no float32 Gather table, no float32
LayerNormalization, no ``cast_in`` Cast on the embedding); BERT's norm is one
more AddLayerNorm, which takes the token type rows as its residual where the
dynamo export's shapes prove they have the sum's shape; bfloat16 packages
rewrite only regions with no Add left (the CPU EP has no bfloat16 Add) and that the
residual stream does not read in float32 (T5's embedding stays float32); a region
whose values are read elsewhere is left as it was; every package matches the
masked float32 reference on ONNX Runtime's CPU EP within the end-to-end bound.
A compiled package's embedding AddLayerNorm carries its CUDA launch attributes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from stofc.frontend import load_model
from stofc.lower.rewrite import DOMAIN
from stofc.lower.twins import KERNEL_ABI
from stofc.package.ortlib import build_library
from stofc.package.reference import inject_mask
from stofc.package.verify import END_TO_END_BOUND, compare, make_inputs, verify_package
from stofc.pipeline import Instruments, compile_model
from tests.unit.rewrite_helpers import cpu_session, rewrite_graph
from tests.unit.test_ortlib_package import attrs, check_cuda_attributes

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(ROOT / "examples"))
from build_model import build_model  # noqa: E402

MASK = "sliding:window=8"
L_MAX = 32
F16, BF16, F32 = TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT
BERT_LN = "/model/embeddings/LayerNorm/LayerNormalization_output_0"   # TorchScript names
BERT_SUM = "/model/embeddings/Add_output_0"                           # word + token type
BERT_TABLES = [f"model.embeddings.{t}_embeddings.weight" for t in ("word", "position", "token_type")]
GPT2_TABLES = ["model.wte.weight", "model.wpe.weight"]


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    return build_library(tmp_path_factory.mktemp("lib"))


def rewrite(model: onnx.ModelProto | str, tmp_path: Path, dtype: str = "float16"):
    """(graph, formats, rewritten model, emitted segments) of a fixture name or a model."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = FIXTURES / f"{model}.onnx" if isinstance(model, str) else tmp_path / "model.onnx"
    if not isinstance(model, str):
        onnx.save(model, str(path))
    graph = load_model(path)
    formats, rewritten, emitted = rewrite_graph(graph, MASK, tmp_path, max_seq_len=L_MAX,
                                                dtype=dtype, causal_from_graph=True)
    return graph, formats, rewritten, emitted


def assert_matches_reference(graph, formats, model: onnx.ModelProto, library: Path) -> None:
    """Every output on the CPU EP within the bound of the masked float32 reference, at
    several lengths with right-padded rows (make_inputs)."""
    pkg = cpu_session(model, library)
    ref = ort.InferenceSession(inject_mask(graph, formats).SerializeToString(),
                               providers=["CPUExecutionProvider"])
    names = [o.name for o in ref.get_outputs()]
    rng = np.random.default_rng(0)
    for batch, seq in ((2, L_MAX), (3, 21), (4, 9)):
        feeds, real = make_inputs(graph, batch, seq, rng)
        for name, out, want in zip(names, pkg.run(names, feeds), ref.run(names, feeds),
                                   strict=True):
            err, scale, n = compare(out, want, real)
            assert n > 0 and err / scale <= END_TO_END_BOUND, (name, batch, seq, err, scale)


def inits(model: onnx.ModelProto) -> dict[str, TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def producer(model: onnx.ModelProto, value: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if value in n.output)


def count(model: onnx.ModelProto, op: str) -> int:
    return sum(n.op_type == op for n in model.graph.node)


def table_gather(model: onnx.ModelProto, table: str) -> onnx.NodeProto:
    """The one node reading the initializer ``table``: a Gather."""
    (gather,) = [n for n in model.graph.node if table in n.input]
    assert gather.op_type == "Gather" and gather.input[0] == table
    return gather


T5_EMBEDDING = "/model/encoder/embed_tokens/Gather_output_0"


def embedding_notes(emitted) -> list[str]:
    return [e.note for e in emitted if "embedding in" in e.note]


def cast_in(model: onnx.ModelProto, value: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "Cast" and list(n.input) == [value]]


def assert_in_dtype(model: onnx.ModelProto, value: str, dtype: int,
                    tables: list[str]) -> onnx.NodeProto:
    """``value`` (the embedding) exists only as its dtype twin, gathered from ``tables``
    stored in the dtype (the float32 ones gone); returns the twin's producer."""
    init = inits(model)
    tag = {F16: "f16", BF16: "bf16"}[dtype]
    for table in tables:
        assert table not in init
        assert init[table_gather(model, f"{table}::stofc_{tag}").input[0]].data_type == dtype
    assert not any(value in n.output for n in model.graph.node)
    assert not cast_in(model, value)
    return producer(model, f"{value}::stofc_{tag}")


def assert_float32_embedding(model: onnx.ModelProto, value: str, tables: list[str],
                             emitted) -> None:
    """The embedding left as the model wrote it: float32 tables, the value Cast to enter."""
    init = inits(model)
    assert all(init[table_gather(model, t).input[0]].data_type == F32 for t in tables)
    assert len(cast_in(model, value)) == 1
    assert not embedding_notes(emitted)


@pytest.mark.parametrize("fixture", ["bert_ts_op17_eager", "bert_dynamo_op18"])
def test_bert_embedding_runs_in_float16(fixture, tmp_path, library):
    graph, formats, model, emitted = rewrite(fixture, tmp_path / "f16")
    # the bfloat16 package of the same model, whose embedding needs an Add, is the "before"
    _, _, before, before_emitted = rewrite(fixture, tmp_path / "bf16", dtype="bfloat16")
    value = next(n for n in graph.model.graph.node if n.op_type == "LayerNormalization"
                 and n.input[1] == "model.embeddings.LayerNorm.weight").output[0]
    assert_float32_embedding(before, value, BERT_TABLES, before_emitted)
    norm = assert_in_dtype(model, value, F16, BERT_TABLES)
    assert norm.domain == DOMAIN and norm.op_type == "AddLayerNorm"
    assert count(model, "AddLayerNorm") == count(before, "AddLayerNorm") + 1
    assert count(model, "LayerNormalization") == 0 and count(before, "LayerNormalization") == 1
    init = inits(model)
    assert [init[p].data_type for p in norm.input[2:]] == [F16, F16]
    assert abs(attrs(norm)["epsilon"] - 1e-12) < 1e-15
    x_node = producer(model, norm.input[0])
    if fixture.startswith("bert_dynamo"):
        # the shapes prove word and token type rows are [B, S, C]: the norm adds the token
        # types as its residual, one Add (words + the [1, S, C] positions) before it
        assert x_node.op_type == "Add" and count(model, "Add") == count(before, "Add") - 1
        assert producer(model, norm.input[1]).input[0] == \
            "model.embeddings.token_type_embeddings.weight::stofc_f16"
    else:
        # TorchScript's inferred shapes are unnamed: nothing proves a [B, S, C] summand
        assert norm.input[1] == "" and x_node.op_type == "Add"
        assert producer(model, x_node.input[0]).op_type == "Add"
        assert count(model, "Add") == count(before, "Add")
    assert len(notes := embedding_notes(emitted)) == 1 and "float16" in notes[0]
    assert_matches_reference(graph, formats, model, library)


@pytest.mark.parametrize("fixture", ["gpt2_ts_op17_eager", "gpt2_dynamo_op18"])
def test_gpt2_embedding_runs_in_float16(fixture, tmp_path, library):
    graph, formats, model, emitted = rewrite(fixture, tmp_path)
    wte = next(n for n in graph.model.graph.node
               if n.op_type == "Gather" and n.input[0] == "model.wte.weight")
    value = next(n for n in graph.model.graph.node if wte.output[0] in n.input
                 and n.op_type == "Add").output[0]
    add = assert_in_dtype(model, value, F16, GPT2_TABLES)
    assert add.op_type == "Add" and add.domain == ""
    assert {producer(model, v).input[0] for v in add.input} == \
        {"model.wte.weight::stofc_f16", "model.wpe.weight::stofc_f16"}
    assert len(embedding_notes(emitted)) == 1
    assert_matches_reference(graph, formats, model, library)


def test_lone_gather_t5(tmp_path, library):
    """T5's token embedding is one Gather: a float16 package gathers it from a float16
    table."""
    graph, formats, model, emitted = rewrite("t5_ts_op17", tmp_path)
    gather = assert_in_dtype(model, T5_EMBEDDING, F16, ["model.shared.weight"])
    assert gather.op_type == "Gather"
    assert len(notes := embedding_notes(emitted)) == 1 and "float16" in notes[0]
    assert_matches_reference(graph, formats, model, library)


def test_bfloat16_keeps_t5s_embedding_float32_for_the_residual_stream(tmp_path, library):
    """A bfloat16 package keeps T5's (Add-free) embedding float32: it is the first value of
    the residual stream, which bf16 packages add in float32 (stofc.lower.stream), so the
    table stays float32, the stream's first Add reads the float row, and only the first
    norm reads it through the Cast."""
    graph, formats, model, emitted = rewrite("t5_ts_op17", tmp_path, dtype="bfloat16")
    assert_float32_embedding(model, T5_EMBEDDING, ["model.shared.weight"], emitted)
    adds = [n for n in model.graph.node if n.op_type == "Add" and T5_EMBEDDING in n.input]
    assert [n.name.startswith("stofc/stream_add") for n in adds] == [True]
    assert_matches_reference(graph, formats, model, library)


@pytest.mark.parametrize("fixture", ["bert_ts_op17_eager", "gpt2_ts_op17_eager"])
def test_bfloat16_keeps_an_embedding_that_needs_an_add(fixture, tmp_path):
    _, _, model, emitted = rewrite(fixture, tmp_path, dtype="bfloat16")
    if fixture.startswith("bert"):
        assert_float32_embedding(model, BERT_LN, BERT_TABLES, emitted)
    else:
        assert_float32_embedding(model, "/model/Add_output_0", GPT2_TABLES, emitted)


def without_summand(model: onnx.ModelProto, table: str) -> onnx.ModelProto:
    """``model`` without the Gather of ``table`` in its embedding sum."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    gather = next(n for n in out.graph.node if n.op_type == "Gather" and n.input[0] == table)
    add = next(n for n in out.graph.node if gather.output[0] in n.input)
    other = next(i for i in add.input if i != gather.output[0])
    for node in out.graph.node:
        for i, name in enumerate(node.input):
            if name == add.output[0]:
                node.input[i] = other
    out.graph.node.remove(add)
    out.graph.node.remove(gather)
    return out


def test_bfloat16_folds_two_summands_into_the_norm(tmp_path, library):
    """Word + token type rows (BERT without positions): AddLayerNorm(words, token types) with
    bfloat16 tables and float32 gamma / beta, no Add, in a bfloat16 package."""
    model = without_summand(onnx.load(str(FIXTURES / "bert_dynamo_op18.onnx")),
                            "model.embeddings.position_embeddings.weight")
    graph, formats, rewritten, emitted = rewrite(model, tmp_path, dtype="bfloat16")
    norm = assert_in_dtype(rewritten, "layer_norm", BF16, [BERT_TABLES[0], BERT_TABLES[2]])
    assert norm.op_type == "AddLayerNorm"
    assert [producer(rewritten, v).op_type for v in norm.input[:2]] == ["Gather", "Gather"]
    init = inits(rewritten)
    assert [init[p].data_type for p in norm.input[2:]] == [F32, F32]
    assert len(embedding_notes(emitted)) == 1
    assert_matches_reference(graph, formats, rewritten, library)


def read_elsewhere(model: onnx.ModelProto, value: str, *, by_node: bool) -> onnx.ModelProto:
    """``model`` with ``value`` also a graph output, or read by a Neg whose result is one."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    name = value
    if by_node:
        name = f"{value}/neg"
        out.graph.node.append(helper.make_node("Neg", [value], [name], name=f"{name}_node"))
    out.graph.output.append(helper.make_tensor_value_info(name, F32, None))
    return out


@pytest.mark.parametrize("value,by_node", [(BERT_LN, False), (BERT_SUM, True)],
                         ids=["embedding_is_an_output", "inner_sum_read_by_a_node"])
def test_region_read_elsewhere_is_left_unchanged(value, by_node, tmp_path, library):
    model = read_elsewhere(onnx.load(str(FIXTURES / "bert_ts_op17_eager.onnx")), value,
                           by_node=by_node)
    graph, formats, rewritten, emitted = rewrite(model, tmp_path)
    assert_float32_embedding(rewritten, BERT_LN, BERT_TABLES, emitted)
    assert count(rewritten, "LayerNormalization") == 1
    assert [o.name for o in rewritten.graph.output] == [o.name for o in model.graph.output]
    assert_matches_reference(graph, formats, rewritten, library)


def with_token_types(model: onnx.ModelProto) -> onnx.ModelProto:
    """The example gathering its token type rows by a ``token_type_ids`` input (as HF BERT
    does when given one) instead of the constant row 0, which the loader folds away."""
    gather = next(n for n in model.graph.node if n.op_type == "Gather"
                  and n.input[0] == "embeddings.token_type_embeddings.weight")
    gather.input[1] = "token_type_ids"
    model.graph.input.append(helper.make_tensor_value_info("token_type_ids", TensorProto.INT64,
                                                           ["batch", "sequence"]))
    return model


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_compiled_package_launches_the_embedding_norm(dtype, tmp_path):
    """compile_model: the embedding AddLayerNorm gets an Add+Norm kernel (width 128) like the
    layers' norms; plan.json's segment note says so; the package verifies on the CPU EP.
    bf16: word + token type rows only (no Add), folded into the norm with float gamma/beta."""
    model = with_token_types(build_model())
    if dtype == "bf16":
        model = without_summand(model, "embeddings.position_embeddings.weight")
    source = tmp_path / "model.onnx"
    onnx.save(model, str(source))
    pkg = compile_model(source, MASK, dtype=dtype, max_seq_len=64, out_dir=tmp_path / "pkg",
                        instruments=Instruments(progress=False))
    rewritten = onnx.load(str(pkg / "model.onnx"))
    norm = next(n for n in rewritten.graph.node if n.op_type == "AddLayerNorm"
                and n.input[2].startswith("/embeddings/LayerNorm.weight"))
    a = attrs(norm)
    assert a["kernel_abi"] == KERNEL_ABI and a["epilogue_kernel"], a
    entry = a["epilogue_kernel"].split(":")[1]
    want = ("stofc_add_norm_float16_ln_n128_" if dtype == "fp16"
            else "stofc_add_norm_bfloat16_f32p_r_ln_n128_")
    assert entry.startswith(want), entry
    assert check_cuda_attributes(pkg)["AddLayerNorm"] == 5
    doc = json.loads((pkg / "plan.json").read_text())
    assert sum(norm.name in s["note"] for s in doc["segments"]) == 1
    report = verify_package(pkg, cases=[(2, 64), (3, 37)])
    assert report.passed, report.worst
