"""The longest sequence a model can run: its absolute position-embedding table.

A model with learned absolute positions (BERT, RoBERTa, GPT-2, DistilBERT,
ELECTRA) gathers rows of a constant ``[P, hidden]`` table by position, so it
cannot run sequences longer than ``P`` tokens, whatever the package claims. A
table is recognised as a ``Gather`` whose data is a constant 2-D table of
width ``hidden`` (``num_heads * head_dim`` of an attention layer) and whose
indices are not constant and are positions: they come from an input named
``*position*``, or from no graph input at all and through a ``Range`` or a
constant ``0, 1, 2, ...`` buffer sliced to the length (HF's ``position_ids``
buffer). Token and token-type embeddings (``input_ids``, a zeros buffer) are
not matched, nor are T5's ``[buckets, heads]`` relative-position buckets. A
model whose positions are computed from ``input_ids`` (RoBERTa) is not
matched either: the check is conservative, it never refuses a length the
model can run.

:func:`max_positions` gives ``P`` (the smallest such table) or ``None``;
``stofc compile`` refuses ``--max-seq-len`` above it and defaults to it when
it is shorter than 512.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper
from onnx.reference import ReferenceEvaluator

from stofc.errors import PlanError
from stofc.frontend.graph import GraphIndex
from stofc.frontend.types import ModelGraph


@dataclass(frozen=True)
class PositionTable:
    """A position-embedding table: its initializer, its rows and the Gather reading it."""

    name: str
    rows: int
    node: str


def position_tables(graph: ModelGraph) -> list[PositionTable]:
    """Every absolute position-embedding table of ``graph`` (module doc)."""
    widths = {layer.attention.num_heads * layer.attention.head_dim for layer in graph.layers}
    if not widths:
        return []
    idx = GraphIndex(graph.model)
    found = []
    for node in graph.model.graph.node:
        if node.op_type != "Gather" or len(node.input) < 2:
            continue
        if int(idx.attr(node, "axis", 0) or 0) != 0:
            continue
        shape = idx.shape(node.input[0])
        if not shape or len(shape) != 2 or shape[1] not in widths or not idx.is_initializer_like(
                node.input[0]) or not isinstance(shape[0], int):
            continue
        if idx.is_initializer_like(node.input[1]):
            continue  # constant indices: a fixed row, not positions
        sources = idx.sources(node.input[1])
        if (sources and all("position" in s.lower() for s in sources)) or (not sources and _counts_up(idx, graph, node.input[1])):
            found.append(PositionTable(node.input[0], int(shape[0]), node.name))
    return found


PROBE = 7  # an odd length no exporter bakes in


def _counts_up(idx: GraphIndex, graph: ModelGraph, value: str) -> bool:
    """``value`` (computed from shapes and constants only) is ``0, 1, ..., S-1`` along its
    last axis when the inputs have length ``S``: positions, not token types (HF gathers
    a zeros buffer *by* the positions there). Evaluated on the few nodes it needs, with
    inputs of length ``PROBE``."""
    nodes = idx.ancestors(value, through_shape=True, limit=200)
    if not nodes or len(nodes) >= 200:
        return False
    names = {n.name for n in nodes}
    ordered = [n for n in graph.model.graph.node if n.name in names]
    used = {i for n in ordered for i in n.input if i}
    inits = [t for t in graph.model.graph.initializer if t.name in used]
    inputs = [i for i in graph.model.graph.input if i.name in used]
    feeds = {}
    for vi in inputs:
        dims = [d.dim_value if d.dim_value > 0 else (1 if k == 0 else PROBE)
                for k, d in enumerate(vi.type.tensor_type.shape.dim)]
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        feeds[vi.name] = np.zeros(dims, dtype)
    sub = helper.make_graph(ordered, "positions", inputs, [helper.make_value_info(value, onnx.TypeProto())],
                            initializer=inits)
    model = helper.make_model(sub, opset_imports=list(graph.model.opset_import))
    try:
        (out,) = ReferenceEvaluator(model).run(None, feeds)
    except Exception:  # an op the reference evaluator lacks: not recognised, never refused
        return False
    out = np.asarray(out)
    return (out.ndim >= 1 and out.shape[-1] == PROBE
            and bool(np.all(out == np.arange(PROBE))))


def max_positions(graph: ModelGraph) -> PositionTable | None:
    """The smallest position table of ``graph``, or None when it has none."""
    tables = position_tables(graph)
    return min(tables, key=lambda t: t.rows) if tables else None


def check_positions(graph: ModelGraph, max_seq_len: int) -> None:
    """Refuse a ``max_seq_len`` the model's position table cannot serve."""
    table = max_positions(graph)
    if table is not None and max_seq_len > table.rows:
        raise PlanError(f"--max-seq-len {max_seq_len} is longer than the model's position table "
                        f"'{table.name}' ({table.rows} positions, read by {table.node}): the model "
                        f"cannot run sequences longer than {table.rows} tokens",
                        hint=f"use --max-seq-len {table.rows} or less")
