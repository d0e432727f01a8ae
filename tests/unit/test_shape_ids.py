"""Embedding ids computed from the input shapes alone (:mod:`stofc.lower.shape_ids`).

On the exporter fixtures: HF BERT's token type ids (a zeros buffer gathered by the positions)
are one constant row and its position ids (a ``0, 1, 2, ...`` buffer sliced to the length) are
positions, from TorchScript and dynamo alike; GPT-2's positions (a Range) too; ``input_ids``
and Optimum's ``token_type_ids`` input are not. On small graphs: ids that read an input's data
(RoBERTa-style positions counted from ``input_ids``), positions with an offset, a position
buffer shorter than the package's length, a random op, non-integer ids, and an empty range
are not classified; a buffer of ones is row 1.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from stofc.frontend import load_model
from stofc.frontend.graph import GraphIndex
from stofc.lower.shape_ids import Positions, Row, probes, shape_only_ids
from stofc.package.positions import max_positions

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _gather_ids(model: onnx.ModelProto, table: str) -> str:
    return next(n.input[1] for n in model.graph.node
                if n.op_type == "Gather" and n.input[0] == table)


@pytest.mark.parametrize("fixture,prefix", [("bert_ts_op17", "model."), ("bert_dynamo_op18", "model."),
                                            ("bert_optimum_op18", "")])
def test_bert_token_types_are_row_0_and_positions_are_positions(fixture, prefix):
    graph = load_model(FIXTURES / f"{fixture}.onnx")
    table_rows = max_positions(graph)
    assert table_rows is not None
    idx = GraphIndex(graph.model)
    table = {t: f"{prefix}embeddings.{t}_embeddings.weight"
             for t in ("word", "token_type", "position")}
    ids = {t: _gather_ids(graph.model, name) for t, name in table.items()}
    assert shape_only_ids(idx, ids["word"], 32) is None                 # input_ids: data
    assert shape_only_ids(idx, ids["position"], 32) == Positions()
    want = None if fixture == "bert_optimum_op18" else Row(0)           # an input there
    assert shape_only_ids(idx, ids["token_type"], 32) == want
    assert shape_only_ids(idx, ids["position"], table_rows.rows) == Positions()
    # beyond the position buffer's rows the slice stops growing: not positions
    assert shape_only_ids(idx, ids["position"], table_rows.rows + 1) is None


@pytest.mark.parametrize("fixture", ["gpt2_ts_op17", "gpt2_dynamo_op18"])
def test_gpt2_positions_from_a_range(fixture):
    graph = load_model(FIXTURES / f"{fixture}.onnx")
    idx = GraphIndex(graph.model)
    assert shape_only_ids(idx, _gather_ids(graph.model, "model.wpe.weight"), 32) == Positions()


def _ids_model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto],
               out_type: int = TensorProto.INT64) -> GraphIndex:
    """``input_ids [batch, seq]`` -> nodes -> ``ids`` (rank 2), as a model's index; the nodes
    named uniquely, as :func:`~stofc.frontend.load_model` names them."""
    for i, node in enumerate(nodes):
        node.name = f"{node.op_type}_{i}"
    graph = helper.make_graph(
        nodes, "ids", [helper.make_tensor_value_info("input_ids", TensorProto.INT64,
                                                     ["batch", "seq"])],
        [helper.make_tensor_value_info("ids", out_type, ["b", "s"])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return GraphIndex(onnx.shape_inference.infer_shapes(model))


def _const(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values, np.int64), name)


def _slice_of(buffer: np.ndarray, extra: list[onnx.NodeProto] | None = None,
              out: str = "ids", out_type: int = TensorProto.INT64) -> GraphIndex:
    """``buffer[:, :S]`` (HF's sliced buffer), then ``extra`` nodes."""
    nodes = [helper.make_node("Shape", ["input_ids"], ["shape"]),
             helper.make_node("Slice", ["shape", "one", "two"], ["len"]),
             helper.make_node("Slice", ["buffer", "zero", "len", "one"],
                              ["sliced" if extra else out]), *(extra or [])]
    return _ids_model(nodes, [_const("buffer", buffer), _const("zero", [0]),
                              _const("one", [1]), _const("two", [2])], out_type)


def test_small_graphs():
    positions = np.arange(64)[None]
    assert shape_only_ids(_slice_of(positions), "ids", 64) == Positions()
    assert shape_only_ids(_slice_of(positions), "ids", 0) is None        # no lengths to probe
    assert shape_only_ids(_slice_of(np.ones((1, 64))), "ids", 64) == Row(1)
    offset = [helper.make_node("Add", ["sliced", "two"], ["ids"])]     # RoBERTa-like +2
    assert shape_only_ids(_slice_of(positions, offset), "ids", 64) is None
    assert shape_only_ids(_slice_of(positions), "ids", 65) is None       # buffer too short
    # positions counted from the tokens (RoBERTa): the ids read input_ids' data
    counted = _ids_model([helper.make_node("Cast", ["input_ids"], ["f"], to=TensorProto.INT64),
                          helper.make_node("CumSum", ["f", "one"], ["ids"])], [_const("one", 1)])
    assert shape_only_ids(counted, "ids", 64) is None
    # a random op is never evaluated
    noisy = [helper.make_node("RandomUniformLike", ["sliced"], ["r"], dtype=TensorProto.FLOAT),
             helper.make_node("Cast", ["r"], ["ids"], to=TensorProto.INT64)]
    assert shape_only_ids(_slice_of(positions, noisy), "ids", 64) is None
    # float ids are not ids
    as_float = [helper.make_node("Cast", ["sliced"], ["ids"], to=TensorProto.FLOAT)]
    graph = _slice_of(positions, as_float, out_type=TensorProto.FLOAT)
    assert graph.elem_type("ids") == TensorProto.FLOAT
    assert shape_only_ids(graph, "ids", 64) is None


def test_hf_token_types_from_a_buffer_wider_than_64():
    """HF BERT's token types: a zeros buffer expanded to the batch and gathered by the
    positions (GatherElements). onnx's reference evaluator fails on it beyond 64 columns
    (np.choose), as the 32K-position export showed on the H100 (2026-11-27)."""
    nodes = [helper.make_node("Shape", ["input_ids"], ["shape"]),
             helper.make_node("Slice", ["shape", "one", "two"], ["len"]),
             helper.make_node("Slice", ["positions", "zero", "len", "one"], ["pos"]),
             helper.make_node("Slice", ["shape", "zero", "one"], ["batch"]),
             helper.make_node("Shape", ["pos"], ["pshape"]),
             helper.make_node("Slice", ["pshape", "zero", "one"], ["pbatch"]),
             helper.make_node("Concat", ["pbatch", "width"], ["eshape"], axis=0),
             helper.make_node("Expand", ["zeros", "eshape"], ["wide"]),
             helper.make_node("GatherElements", ["wide", "pos"], ["gathered"], axis=1),
             helper.make_node("Concat", ["batch", "len"], ["full"], axis=0),
             helper.make_node("Expand", ["gathered", "full"], ["ids"])]
    idx = _ids_model(nodes, [_const("positions", np.arange(300)[None]),
                             _const("zeros", np.zeros((1, 300))), _const("zero", [0]),
                             _const("one", [1]), _const("two", [2]), _const("width", [300])])
    assert shape_only_ids(idx, "ids", 300) == Row(0)
    assert shape_only_ids(idx, "pos", 300) == Positions()


def test_probes_cover_both_ends_and_the_tile_edges():
    assert probes(4096) == [(1, 1), (2, 2), (3, 7), (1, 63), (2, 64), (3, 65), (1, 257),
                            (2, 4095), (3, 4096)]
    assert probes(2) == [(1, 1), (2, 2)]
    assert probes(0) == []
