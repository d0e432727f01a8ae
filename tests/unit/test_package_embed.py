"""The embedding in the package dtype (:mod:`stofc.lower.embed`).

Checked here on the exporter fixtures (head_dim 16: rewrite only, CPU twins): HF
BERT and GPT-2 (TorchScript and dynamo) and T5 gather from float16 tables and
write the first fused op's input directly (no float32 Gather table, no float32
LayerNormalization, no ``cast_in`` Cast on the embedding). BERT's embedding (a norm
over three Gathers whose ids are 2-D) is ONE ``EmbedLayerNorm`` reading the model's ids and
the tables in the dtype, in float16 and in bfloat16 packages alike (no ONNX Add is left, so
the CPU EP's missing bfloat16 Add does not matter; gamma / beta float32 in bfloat16); a region
it cannot take (a Shape node reading a Gather result) keeps the Gathers, the Adds in the dtype
and an AddLayerNorm, which takes the token type rows as its residual where the dynamo export's
shapes prove they have the sum's shape; bfloat16 packages rewrite that form only with no Add
left, and never an embedding the residual stream reads in float32 (T5's); a region whose
values are read elsewhere is left as it was; every package matches the masked float32
reference on ONNX Runtime's CPU EP within the end-to-end bound. A compiled package's
EmbedLayerNorm carries its CUDA launch attributes and its kernel.
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
from stofc.frontend.graph import GraphIndex
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
BERT_SUMMANDS = [BERT_TABLES[i] for i in (0, 2, 1)]   # (words + token types) + positions
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


ROW_0 = "a [1, 1] int64 initializer holding 0"


def assert_embed_layer_norm(model: onnx.ModelProto, original: onnx.ModelProto, value: str,
                            dtype: int, tables: list[str], ids: list[str] | None = None
                            ) -> onnx.NodeProto:
    """``value`` (the embedding) is written by one EmbedLayerNorm in ``dtype`` that reads, in
    the model's order, each of ``tables`` in the dtype (nothing else reads them) with ``ids``
    (default: the ids the model's Gather of it read; :data:`ROW_0`: a constant row 0); no
    Gather, Add or LayerNormalization of the region is left, nor the float32 tables or the
    Cast. Returns the node."""
    init = inits(model)
    tag = {F16: "f16", BF16: "bf16"}[dtype]
    node = producer(model, f"{value}::stofc_{tag}")
    assert node.domain == DOMAIN and node.op_type == "EmbedLayerNorm"
    gathers = {n.input[0]: n for n in original.graph.node if n.op_type == "Gather"}
    ids = ids or [gathers[t].input[1] for t in tables]
    for k, want_ids in enumerate(ids):
        if want_ids == ROW_0:
            row = init[node.input[2 * k]]
            assert row.data_type == TensorProto.INT64 and list(row.dims) == [1, 1]
            assert onnx.numpy_helper.to_array(row).tolist() == [[0]]
        else:
            assert node.input[2 * k] == want_ids
    assert list(node.input[1:2 * len(tables):2]) == [f"{t}::stofc_{tag}" for t in tables]
    assert all(name == "" for name in node.input[2 * len(tables):6])
    for table in tables:
        assert table not in init and init[f"{table}::stofc_{tag}"].data_type == dtype
        assert [n.name for n in model.graph.node if f"{table}::stofc_{tag}" in n.input] == \
            [node.name]
    assert not any(value in n.output for n in model.graph.node)
    assert not cast_in(model, value)
    return node


def assert_float32_embedding(model: onnx.ModelProto, value: str, tables: list[str],
                             emitted) -> None:
    """The embedding left as the model wrote it: float32 tables, the value Cast to enter."""
    init = inits(model)
    assert all(init[table_gather(model, t).input[0]].data_type == F32 for t in tables)
    assert len(cast_in(model, value)) == 1
    assert not embedding_notes(emitted)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fixture", ["bert_ts_op17_eager", "bert_dynamo_op18"])
def test_bert_embedding_is_one_embed_layer_norm(fixture, dtype, tmp_path, library):
    graph, formats, model, emitted = rewrite(fixture, tmp_path / "pkg", dtype)
    # the same model with its embedding also a graph output keeps the region: the "before"
    value = next(n for n in graph.model.graph.node if n.op_type == "LayerNormalization"
                 and n.input[1] == "model.embeddings.LayerNorm.weight").output[0]
    _, _, before, before_emitted = rewrite(
        read_elsewhere(onnx.load(str(FIXTURES / f"{fixture}.onnx")), value, by_node=False),
        tmp_path / "before", dtype)
    assert_float32_embedding(before, value, BERT_TABLES, before_emitted)
    elem = {"float16": F16, "bfloat16": BF16}[dtype]
    # words + token types + positions, in the model's order: the token types (a zeros buffer
    # gathered by the positions) are one constant row, the positions (a 0, 1, 2, ... buffer
    # sliced to the length) are read by position in the op (stofc.lower.shape_ids), so the
    # ~22 shape nodes ahead of the embedding are gone: only the output's Cast is left
    node = assert_embed_layer_norm(model, graph.model, value, elem, BERT_SUMMANDS,
                                   ids=["input_ids", ROW_0, ""])
    assert GraphIndex(graph.model).rank(node.input[0]) == 2
    assert [n.op_type for n in model.graph.node if n.domain != DOMAIN] == ["Cast"]
    assert count(before, "Shape") > 0 and count(before, "Expand") > 0
    init = inits(model)
    params = [elem, elem] if dtype == "float16" else [F32, F32]   # bf16: float32 (OPS.md)
    assert [init[p].data_type for p in node.input[6:]] == params
    assert abs(attrs(node)["epsilon"] - 1e-12) < 1e-15
    assert count(model, "Gather") == 0 and count(before, "Gather") >= 3
    assert count(before, "Add") - count(model, "Add") == 2
    assert count(model, "LayerNormalization") == 0 and count(before, "LayerNormalization") == 1
    assert count(model, "AddLayerNorm") == count(before, "AddLayerNorm")
    assert len(notes := embedding_notes(emitted)) == 1
    assert f"embedding in {dtype}: EmbedLayerNorm ({node.name}) write " in notes[0]
    assert "float32 Gather x3" in notes[0] and "float32 Add x2" in notes[0]
    assert notes[0].endswith("ids computed from shapes alone read in the op: "
                             "model.embeddings.token_type_embeddings.weight row 0 for every "
                             "token, model.embeddings.position_embeddings.weight by sequence "
                             "position")
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


def test_bfloat16_keeps_an_embedding_that_needs_an_add(tmp_path):
    """GPT-2's embedding is a sum without a norm: in bfloat16 its Add would remain."""
    _, _, model, emitted = rewrite("gpt2_ts_op17_eager", tmp_path, dtype="bfloat16")
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


def test_bfloat16_two_summands_are_one_embed_layer_norm(tmp_path, library):
    """Word + token type rows (BERT without positions): EmbedLayerNorm of two bfloat16 tables
    with float32 gamma / beta, in a bfloat16 package."""
    original = without_summand(onnx.load(str(FIXTURES / "bert_dynamo_op18.onnx")),
                               "model.embeddings.position_embeddings.weight")
    graph, formats, rewritten, emitted = rewrite(original, tmp_path, dtype="bfloat16")
    node = assert_embed_layer_norm(rewritten, graph.model, "layer_norm", BF16,
                                   [BERT_TABLES[0], BERT_TABLES[2]], ids=["input_ids", ROW_0])
    init = inits(rewritten)
    assert [init[p].data_type for p in node.input[6:]] == [F32, F32]
    assert len(embedding_notes(emitted)) == 1
    assert_matches_reference(graph, formats, rewritten, library)


def test_implicit_ids_need_the_first_ids_to_be_a_graph_input(tmp_path, library):
    """Word ids that are not a graph input (here cast to int32): the op's [B, S] would come
    from them alone, unproven, so the shape-only token type and position ids stay as the
    model computes them."""
    original = onnx.load(str(FIXTURES / "bert_ts_op17_eager.onnx"))
    words = next(n for n in original.graph.node if n.op_type == "Gather"
                 and n.input[0] == BERT_TABLES[0])
    words.input[1] = "input_ids/int32"
    original.graph.node.insert(0, helper.make_node("Cast", ["input_ids"], ["input_ids/int32"],
                                                   name="ids_int32", to=TensorProto.INT32))
    graph, formats, model, emitted = rewrite(original, tmp_path)
    assert_embed_layer_norm(model, graph.model, BERT_LN, F16, BERT_SUMMANDS)   # the model's ids
    assert "ids computed from shapes alone" not in embedding_notes(emitted)[0]
    assert_matches_reference(graph, formats, model, library)


def with_shape_of_a_summand(model: onnx.ModelProto, table: str) -> onnx.ModelProto:
    """``model`` with the shape of ``table``'s gathered rows also a graph output: the Gather
    result must stay, so the region cannot be one EmbedLayerNorm."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    gather = next(n for n in out.graph.node if n.op_type == "Gather" and n.input[0] == table)
    name = f"{gather.output[0]}/shape"
    out.graph.node.append(helper.make_node("Shape", [gather.output[0]], [name],
                                           name=f"{name}_node"))
    out.graph.output.append(helper.make_tensor_value_info(name, TensorProto.INT64, None))
    return out


@pytest.mark.parametrize("fixture", ["bert_ts_op17_eager", "bert_dynamo_op18"])
def test_a_gather_result_read_by_shape_keeps_gathers_adds_and_add_layer_norm(fixture, tmp_path,
                                                                            library):
    """The form before EmbedLayerNorm: Gathers from float16 tables, Adds in float16, one
    AddLayerNorm; the dynamo export's shapes prove the token type rows have the sum's shape, so
    the norm adds them as its residual (one Add fewer); TorchScript's do not."""
    original = with_shape_of_a_summand(onnx.load(str(FIXTURES / f"{fixture}.onnx")),
                                       BERT_TABLES[0])
    graph, formats, model, emitted = rewrite(original, tmp_path)
    value = next(n for n in graph.model.graph.node if n.op_type == "LayerNormalization"
                 and n.input[1] == "model.embeddings.LayerNorm.weight").output[0]
    norm = assert_in_dtype(model, value, F16, BERT_TABLES)
    assert norm.domain == DOMAIN and norm.op_type == "AddLayerNorm"
    assert count(model, "EmbedLayerNorm") == 0
    init = inits(model)
    assert [init[p].data_type for p in norm.input[2:]] == [F16, F16]
    x_node = producer(model, norm.input[0])
    assert x_node.op_type == "Add"
    if fixture.startswith("bert_dynamo"):
        assert producer(model, norm.input[1]).input[0] == \
            "model.embeddings.token_type_embeddings.weight::stofc_f16"
        assert producer(model, x_node.input[0]).op_type == "Gather"
    else:
        assert norm.input[1] == "" and producer(model, x_node.input[0]).op_type == "Add"
    shape = next(n for n in model.graph.node if n.op_type == "Shape"
                 and n.output[0].endswith("/shape"))
    assert shape.input[0] == table_gather(model, f"{BERT_TABLES[0]}::stofc_f16").output[0]
    assert len(notes := embedding_notes(emitted)) == 1 and "AddLayerNorm" in notes[0]
    assert_matches_reference(graph, formats, model, library)


def test_bfloat16_folds_two_summands_into_the_norm(tmp_path, library):
    """The same form in a bfloat16 package when no Add is left: word + token type rows
    (without positions) as AddLayerNorm(words, token types), float32 gamma / beta."""
    original = with_shape_of_a_summand(
        without_summand(onnx.load(str(FIXTURES / "bert_dynamo_op18.onnx")),
                        "model.embeddings.position_embeddings.weight"), BERT_TABLES[0])
    graph, formats, rewritten, emitted = rewrite(original, tmp_path, dtype="bfloat16")
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


@pytest.mark.parametrize("dtype,positions", [("fp16", True), ("bf16", True), ("bf16", False)],
                         ids=["fp16", "bf16", "bf16-no-positions"])
def test_compiled_package_launches_the_embedding_kernel(dtype, positions, tmp_path):
    """compile_model: the embedding is one EmbedLayerNorm whose CUDA attributes name the
    embedding kernel (width 128) compiled for its summands, beta and gamma type, built into the
    package; plan.json's segment note says so; the package verifies on the CPU EP.
    bf16: float32 gamma / beta (``_f32p``)."""
    model = with_token_types(build_model())
    if not positions:
        model = without_summand(model, "embeddings.position_embeddings.weight")
    source = tmp_path / "model.onnx"
    onnx.save(model, str(source))
    pkg = compile_model(source, MASK, dtype=dtype, max_seq_len=64, out_dir=tmp_path / "pkg",
                        instruments=Instruments(progress=False))
    rewritten = onnx.load(str(pkg / "model.onnx"))
    (node,) = [n for n in rewritten.graph.node if n.op_type == "EmbedLayerNorm"]
    a = attrs(node)
    assert a["kernel_abi"] == KERNEL_ABI and a["kernel"], a
    path, entry = a["kernel"].split(":")
    want = {"fp16": "stofc_embed_norm_float16_e3_ln_n128_t32x4",
            "bf16": f"stofc_embed_norm_bfloat16_f32p_e{3 if positions else 2}_ln_n128_t32x4"}
    assert entry == want[dtype] and path == f"kernels/{entry}.sm_90.cubin"
    assert (pkg / path).read_bytes()[:4] == b"\x7fELF"
    counts = check_cuda_attributes(pkg)
    assert counts["EmbedLayerNorm"] == 1 and counts["AddLayerNorm"] == 4
    doc = json.loads((pkg / "plan.json").read_text())
    assert sum(node.name in s["note"] for s in doc["segments"]) == 1
    report = verify_package(pkg, cases=[(2, 64), (3, 37)])
    assert report.passed, report.worst
