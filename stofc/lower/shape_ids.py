"""Embedding ids computed from the input shapes alone: sequence positions and constant rows.

Why: HF BERT computes its position ids as a slice of a constant ``0, 1, 2, ...`` buffer
and its token type ids by gathering a zeros buffer by those positions. A TorchScript export
spells that as ~22 ONNX nodes (Shape, Gather, Slice, ConstantOfShape, Where, Expand,
GatherElements, ...) that ONNX Runtime runs before the embedding at every call: on a GPU,
shape arithmetic on the host between six tiny launches, while the GPU waits. On an H100
(BERT-base package, CUPTI timeline, ``e2e-long-h100-2026-11-27-gaps2``) the first GEMM
started ~125 us after the run's first GPU activity, at (1, 128) as at (1, 8192).
``EmbedLayerNorm`` (``cuda/ort/OPS.md``) gathers a table by sequence position when its ids
input is absent, and a constant row through a ``[1, 1]`` ids constant, so those nodes go.

Contract of :func:`shape_only_ids`: the ids ``value`` is classified as

* :class:`Positions` when, at every probe ``(B, S)``, it has shape ``[1, S]`` or ``[B, S]``
  and ``value[b, s] == s``;
* :class:`Row` ``(r)`` when, at every probe, it has shape ``[1 or B, 1 or S]`` and every
  entry is the same ``r`` (one ``r`` for all probes);
* ``None`` otherwise, and always when the value depends on a graph input's data, not only
  on its shape (:meth:`GraphIndex.sources`; RoBERTa's positions, counted from
  ``input_ids``), when it is not int32/int64 of rank 2, when its subgraph has more than
  ``MAX_NODES`` nodes, an op outside the standard domain, control flow or a random op, or
  when ONNX Runtime cannot run it.

How it is evaluated: the value's ancestors (through Shape nodes) run in ONNX Runtime's CPU EP
(one session, every probe; onnx's reference evaluator gathers with ``np.choose``, which takes
at most 64 columns, so it fails on HF BERT's token type buffer) with the graph inputs they read
as zeros of the probe's shape (axis 0 of a dynamic dimension is ``B``, any other dynamic axis ``S``; static
dimensions are kept). The probes (:func:`probes`) cover ``S = 1``, small odd lengths, the
64-token tile edges, and ``max_seq_len - 1`` and ``max_seq_len``, at batch sizes 1 to 3.
Since the subgraph reads no data, its output is a function of ``(B, S)`` alone, and
exporters compute such ids with slices and broadcasts, not with branches on the length;
the package's self-check (:mod:`stofc.package.selfcheck`) then runs the package against the
model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from stofc.frontend.graph import GraphIndex

MAX_NODES = 200
NOT_EVALUATED = frozenset({"If", "Loop", "Scan", "RandomNormal", "RandomUniform",
                           "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"})
INT_IDS = (TensorProto.INT64, TensorProto.INT32)


@dataclass(frozen=True)
class Positions:
    """The ids are the token's sequence position ``s``."""


@dataclass(frozen=True)
class Row:
    """Every token's id is ``row``."""

    row: int


def probes(max_seq_len: int) -> list[tuple[int, int]]:
    """The ``(B, S)`` shapes :func:`shape_only_ids` evaluates (module doc)."""
    lengths = sorted({s for s in (1, 2, 7, 63, 64, 65, 257, max_seq_len - 1, max_seq_len)
                      if 1 <= s <= max_seq_len})
    return [(1 + i % 3, s) for i, s in enumerate(lengths)]


def shape_only_ids(idx: GraphIndex, value: str, max_seq_len: int) -> Positions | Row | None:
    """What ``value`` holds when it is a function of the input shapes (module doc). The
    model's node names are unique (:func:`~stofc.frontend.load_model` names them)."""
    if max_seq_len < 1:
        return None
    if idx.elem_type(value) not in INT_IDS or idx.rank(value) != 2 or idx.sources(value):
        return None
    if value in idx.graph_inputs or idx.is_initializer_like(value):
        return None
    nodes = idx.ancestors(value, through_shape=True, limit=MAX_NODES)
    if not nodes or len(nodes) >= MAX_NODES:
        return None
    if any(n.domain not in ("", "ai.onnx") or n.op_type in NOT_EVALUATED for n in nodes):
        return None
    model = _submodel(idx, nodes, value)
    try:
        import onnxruntime as ort  # optional: ONNX Runtime (without it the ids stay as they are)

        options = ort.SessionOptions()
        options.log_severity_level = 4
        session = ort.InferenceSession(model.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        results = []
        for b, s in probes(max_seq_len):
            (out,) = session.run(None, _feeds(model, b, s))
            results.append((b, s, np.asarray(out)))
    except Exception:  # ONNX Runtime cannot run it: the ids stay as they are
        return None
    if all(out.shape in ((1, s), (b, s)) and bool(np.all(out == np.arange(s)))
           for b, s, out in results):
        return Positions()
    firsts = {int(out.flat[0]) for _, _, out in results if out.size}
    if len(firsts) == 1 and all(
            out.ndim == 2 and out.shape[0] in (1, b) and out.shape[1] in (1, s) and out.size
            and bool(np.all(out == out.flat[0])) for b, s, out in results):
        return Row(firsts.pop())
    return None


def _submodel(idx: GraphIndex, nodes: list[onnx.NodeProto], value: str) -> onnx.ModelProto:
    """The model's nodes among ``nodes`` in graph order, computing ``value`` from the graph
    inputs they read and the initializers they use."""
    graph = idx.model.graph
    names = {n.name for n in nodes}
    ordered = [n for n in graph.node if n.name in names]
    used = {i for n in ordered for i in n.input if i}
    inits = [t for t in graph.initializer if t.name in used]
    inputs = [i for i in graph.input if i.name in used and i.name not in idx.initializers]
    elem = idx.elem_type(value) or TensorProto.INT64
    sub = helper.make_graph(ordered, "shape_ids", inputs,
                            [helper.make_tensor_value_info(value, elem, None)], initializer=inits)
    opsets = [o for o in idx.model.opset_import if o.domain in ("", "ai.onnx")]
    return helper.make_model(sub, opset_imports=opsets, ir_version=idx.model.ir_version)


def _feeds(model: onnx.ModelProto, batch: int, seq: int) -> dict[str, np.ndarray]:
    """Zeros for each input of ``model`` at ``(batch, seq)`` (module doc)."""
    feeds = {}
    for vi in model.graph.input:
        dims = [d.dim_value if d.dim_value > 0 else (batch if k == 0 else seq)
                for k, d in enumerate(vi.type.tensor_type.shape.dim)]
        feeds[vi.name] = np.zeros(dims, helper.tensor_dtype_to_np_dtype(
            vi.type.tensor_type.elem_type))
    return feeds


__all__ = ["MAX_NODES", "Positions", "Row", "probes", "shape_only_ids"]
