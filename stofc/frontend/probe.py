"""Run a small piece of the model on probe values: what a recognised pattern must compute.

A matcher that replaces model nodes by an ``ai.stofc`` op whose function it knows (the
RoPE recognition, :mod:`stofc.frontend.rope_fuse`) checks its claim here: the model's own
nodes between the values the op reads and the value it replaces are cut out of the graph
(:func:`cut`) and evaluated on probe inputs (:func:`evaluate`) by ONNX Runtime's CPU
execution provider, the runtime the package itself runs in (without ONNX Runtime nothing
is evaluated: a :class:`ProbeError`); the caller compares the result with its reference.
Names are never looked at.

Contract of :func:`cut`: the nodes are the producers reachable backwards from ``target``
that stop at a fed value (``feeds``), a constant (folded by
:meth:`~stofc.frontend.graph.GraphIndex.const`, given as an initializer) or the ``Shape`` /
``Size`` of a value computed elsewhere (fed from its inferred shape, symbols resolved
through the caller's map; an unknown symbol gets :data:`UNKNOWN_DIM`, which no real
computation survives unnoticed). Anything else (a graph input, a node with a subgraph, more
than ``limit`` nodes) is a :class:`ProbeError` naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from stofc.frontend.graph import GraphIndex

UNKNOWN_DIM = 97   # a dimension the probe cannot know: a prime no probe dimension divides


class ProbeError(Exception):
    """The subgraph cannot be cut out or evaluated; carries the reason."""


@dataclass(frozen=True)
class Cut:
    """The model's nodes computing ``target`` from the fed values (graph order), and the
    ``Shape`` / ``Size`` results of values outside that it reads."""

    target: str
    nodes: tuple[onnx.NodeProto, ...]
    feeds: tuple[str, ...]
    shapes: tuple[tuple[str, onnx.NodeProto], ...]   # (value, the Shape/Size node)
    consts: tuple[str, ...]


def cut(idx: GraphIndex, target: str, feeds: set[str], limit: int = 256) -> Cut:
    """The subgraph from ``feeds`` to ``target`` (module contract), or ProbeError.

    Data edges are followed first; a ``Shape`` / ``Size`` met on the way is evaluated on
    the probe when its input is computed inside the cut (or fed), else fed from that
    input's inferred shape: the cut never follows a shape into the rest of the model.
    """
    nodes: dict[str, onnx.NodeProto] = {}
    pending: dict[str, onnx.NodeProto] = {}
    consts: set[str] = set()
    used: set[str] = set()
    stack, seen = [target], set()
    while stack:
        value = stack.pop()
        if not value or value in seen:
            continue
        seen.add(value)
        if value in feeds:
            used.add(value)
            continue
        if idx.const(value) is not None:
            consts.add(value)
            continue
        node = idx.producer.get(value)
        if node is None:
            raise ProbeError(f"it reads {value}, which is neither computed from "
                             f"{', '.join(sorted(feeds))} nor a constant")
        if node.op_type in ("Shape", "Size"):
            pending[value] = node
            continue
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for a in node.attribute):
            raise ProbeError(f"it passes {node.op_type} node {node.name}, which has a subgraph")
        nodes[node.name] = node
        if len(nodes) > limit:
            raise ProbeError(f"more than {limit} nodes lie between {target} and "
                             f"{', '.join(sorted(feeds))}")
        stack.extend(node.input)
    inside = used | {o for n in nodes.values() for o in n.output if o}
    shapes = {}
    for value, node in pending.items():
        if node.input[0] in inside:
            nodes[node.name] = node       # the shape of a probe value: evaluated
        else:
            shapes[value] = node          # the shape of a value outside: from its inference
    ordered = tuple(sorted(nodes.values(), key=lambda n: idx.position[n.name]))
    return Cut(target, ordered, tuple(sorted(used)), tuple(sorted(shapes.items())),
               tuple(sorted(consts)))


def _shape_value(idx: GraphIndex, node: onnx.NodeProto, symbols: Mapping[str, int]
                 ) -> np.ndarray:
    shape = idx.shape(node.input[0])
    if shape is None:
        raise ProbeError(f"the shape of {node.input[0]} (read by {node.name}) is unknown")
    dims = [d if isinstance(d, int) else symbols.get(str(d), UNKNOWN_DIM) for d in shape]
    if node.op_type == "Size":
        return np.array(int(np.prod(dims)), dtype=np.int64)
    start, end = idx.attr(node, "start", 0), idx.attr(node, "end", None)
    return np.array(dims[start:end], dtype=np.int64)


def evaluate(idx: GraphIndex, piece: Cut, values: Mapping[str, np.ndarray],
             symbols: Mapping[str, int]) -> np.ndarray:
    """``piece.target`` computed by the model's nodes from ``values`` (one array per fed
    value, converted to the value's element type), or ProbeError (the evaluator's error)."""
    inputs, feeds = [], {}
    for name in piece.feeds:
        elem = idx.elem_type(name) or onnx.TensorProto.FLOAT
        feeds[name] = np.asarray(values[name]).astype(helper.tensor_dtype_to_np_dtype(elem))
        inputs.append(helper.make_tensor_value_info(name, elem, None))
    for name, node in piece.shapes:
        feeds[name] = _shape_value(idx, node, symbols)
        inputs.append(helper.make_tensor_value_info(name, onnx.TensorProto.INT64, None))
    inits = [numpy_helper.from_array(np.asarray(idx.const(c)), c) for c in piece.consts]
    out_elem = idx.elem_type(piece.target) or onnx.TensorProto.FLOAT
    graph = helper.make_graph(list(piece.nodes), "probe", inputs,
                              [helper.make_tensor_value_info(piece.target, out_elem, None)],
                              inits)
    model = helper.make_model(graph, opset_imports=list(idx.model.opset_import))
    model.ir_version = idx.model.ir_version
    try:
        (out,) = _run(model, feeds)
    except Exception as err:  # the evaluator's own errors: any op, any failure
        text = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise ProbeError(f"its nodes cannot be evaluated on a probe ({text})") from None
    return np.asarray(out)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list:
    """``model`` on ``feeds`` in ONNX Runtime's CPU EP (no graph optimisation)."""
    try:
        import onnxruntime as ort  # optional: ONNX Runtime
    except ImportError:
        raise ProbeError("ONNX Runtime is not installed, so the subgraph cannot be run on a "
                         "probe") from None
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return list(sess.run(None, feeds))
