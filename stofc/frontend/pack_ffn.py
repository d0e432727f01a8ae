"""Pack a gated FFN's separate gate and up projections into one, before analysis.

Llama, Mistral, Qwen2 and Gemma project the FFN input twice (``gate_proj``,
``up_proj``) and multiply ``act(gate) * up``. Phi-3 and ModernBERT compute the same
with ONE projection of width 2F whose halves are split off. Packing the separate
form into the packed one makes the chain, the plan and the package see one GEMM
producing ``[tokens, 2F]`` (:data:`~stofc.frontend.types.OpKind.GATED` reads its
halves), as :mod:`stofc.frontend.pack` does for Q, K and V.

Contract of :func:`pack_gate_up` (on a canonicalized model):

* For every ``Mul(a, u)`` where ``u`` is ``MatMul(x, Wu)`` (+ ``Add`` of an
  initializer bias ``bu``) and ``a`` is an activation stofc fuses
  (:func:`stofc.frontend.gated.gate_act`: SiLU, GELU erf/tanh, ReLU, decomposed or
  one op) of ``g = MatMul(x, Wg)`` (+ ``Add(bg)``) with the same ``x``, plain
  ``[K, F]`` initializer weights of one shape and type and both biases or neither
  (``[F]``): the two projections become ``MatMul(x, [Wg | Wu]) (-> Add([bg | bu]))
  -> Split(axis=-1, [F, F])`` whose outputs keep the names ``g`` and ``u``, so every
  reader (the activation, the Mul) reads the same values. The function is the same
  (each output column is the same dot product and bias add).
* Skipped (left as they are; the chain then stops at the FFN and says why):
  weights that are not plain initializers or overridden by a graph input, a
  MatMul result read by anything but its bias Add, ``g`` read by anything but the
  activation, ``u`` read by anything but the Mul, either a graph output, biases on
  one projection only, and activations no kernel fuses (QuickGelu, ...).
* New nodes sit where the first replaced node was; old weights no other node reads
  are dropped; the packed values get ``value_info`` from ``g``'s with width 2F.
  Opset < 13 writes the Split's sizes as an attribute.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from stofc.frontend.gated import gate_act
from stofc.frontend.graph import GraphIndex
from stofc.frontend.load import opset_of
from stofc.frontend.ops import activation_fwd
from stofc.frontend.pack import (
    FreshNames,
    concat_initializers,
    packed_info,
    splice,
)


@dataclass(frozen=True)
class PackedGateUp:
    """One gated FFN's gate and up projections, now one MatMul (+ Add) and a Split."""

    replaced: tuple[str, ...]   # the removed MatMul/Add node names (gate, then up)
    nodes: tuple[str, ...]      # the new MatMul, Add (when biased), Split
    weight: str                 # the new [K, 2F] initializer ([Wg | Wu])
    bias: str | None            # the new [2F] initializer


@dataclass(frozen=True)
class GateUpResult:
    """The packed model and what was packed."""

    model: onnx.ModelProto
    packed: tuple[PackedGateUp, ...]


@dataclass(frozen=True)
class _Proj:
    value: str                    # the projection output (gate / up half)
    matmul: onnx.NodeProto
    add: onnx.NodeProto | None
    weight: str
    bias: str | None


def _proj(idx: GraphIndex, value: str, overridden: set[str]) -> _Proj | None:
    """``value`` as ``MatMul(x, W)`` (+ ``Add`` of an initializer bias), or None."""
    if idx.is_graph_output(value):
        return None
    node = idx.produced_by(value)
    add = bias = None
    if node is not None and node.op_type == "Add":
        pair = [(a, b) for a, b in (node.input, node.input[::-1])
                if b in idx.initializers and b not in overridden
                and idx.produced_by(a, "MatMul") is not None]
        if len(pair) != 1:
            return None
        mm_out, bias = pair[0]
        if idx.is_graph_output(mm_out) or len(idx.users(mm_out)) != 1:
            return None
        add, node = node, idx.produced_by(mm_out)
    if node is None or node.op_type != "MatMul":
        return None
    weight = node.input[1]
    if weight not in idx.initializers or weight in overridden \
            or idx.initializers[weight].data_location == onnx.TensorProto.EXTERNAL \
            or len(idx.initializers[weight].dims) != 2:
        return None
    return _Proj(value, node, add, weight, bias)


def _gate_for(idx: GraphIndex, up: _Proj, act_value: str, overridden: set[str]
              ) -> _Proj | None:
    """The gate projection whose fused activation is ``act_value``, beside ``up``."""
    x = up.matmul.input[0]
    shape = tuple(idx.initializers[up.weight].dims)
    dtype = idx.initializers[up.weight].data_type
    for mm in idx.users(x):
        if mm.op_type != "MatMul" or mm.name == up.matmul.name or mm.input[0] != x:
            continue
        users = idx.users(mm.output[0])
        value = users[0].output[0] if len(users) == 1 and users[0].op_type == "Add" \
            else mm.output[0]
        gate = _proj(idx, value, overridden)
        if gate is None or gate.matmul.name != mm.name:
            continue
        w = idx.initializers[gate.weight]
        if tuple(w.dims) != shape or w.data_type != dtype or (gate.bias is None) != (
                up.bias is None):
            continue
        act = activation_fwd(idx, value)
        if act is None or act[1] != act_value or gate_act(act[0]) is None:
            continue
        inside = {n.name for n in act[0].nodes}
        if all(u.name in inside for u in idx.users(value)):
            return gate
    return None


def _biases_fit(idx: GraphIndex, gate: _Proj, up: _Proj) -> bool:
    width = idx.initializers[up.weight].dims[1]
    dtype = idx.initializers[up.weight].data_type
    return all(b is None or (list(idx.initializers[b].dims) == [width]
                             and idx.initializers[b].data_type == dtype)
               for b in (gate.bias, up.bias))


def _match(idx: GraphIndex, mul: onnx.NodeProto, overridden: set[str]
           ) -> tuple[_Proj, _Proj] | None:
    if len(mul.input) != 2 or len(set(mul.input)) != 2:
        return None
    for act_value, up_value in (mul.input, mul.input[::-1]):
        up = _proj(idx, up_value, overridden)
        if up is None or [u.name for u in idx.users(up_value)] != [mul.name]:
            continue
        gate = _gate_for(idx, up, act_value, overridden)
        if gate is not None and _biases_fit(idx, gate, up):
            return gate, up
    return None


def pack_gate_up(model: onnx.ModelProto) -> GateUpResult:
    """``model`` with every gated FFN's gate and up projections packed (module doc).

    ``model`` itself is not changed; the result is a copy (or ``model`` when nothing
    was packed).
    """
    idx = GraphIndex(model)
    overridden = {i.name for i in model.graph.input} & set(idx.initializers)
    pairs: list[tuple[_Proj, _Proj]] = []
    claimed: set[str] = set()
    for node in idx.nodes:
        if node.op_type != "Mul":
            continue
        found = _match(idx, node, overridden)
        if found is None or {p.matmul.name for p in found} & claimed:
            continue
        claimed |= {p.matmul.name for p in found}
        pairs.append(found)
    if not pairs:
        return GateUpResult(model, ())
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = FreshNames(out)
    old_opset = opset_of(model) < 13
    packed, new_inits, removed_values = [], [], set()
    inserts: dict[str, list[onnx.NodeProto]] = {}
    for gate, up in pairs:
        width = int(idx.initializers[gate.weight].dims[1])
        weight = names.fresh(f"{gate.weight}::gate_up")
        new_inits.append(concat_initializers(idx, [gate.weight, up.weight], 1, weight))
        mm_out = names.fresh(f"{gate.matmul.output[0]}::gate_up")
        nodes = [helper.make_node("MatMul", [gate.matmul.input[0], weight], [mm_out],
                                  name=names.fresh(f"{gate.matmul.name}::gate_up"))]
        packed_value, bias = mm_out, None
        if gate.add is not None:
            bias = names.fresh(f"{gate.bias}::gate_up")
            new_inits.append(concat_initializers(idx, [str(gate.bias), str(up.bias)], 0, bias))
            packed_value = names.fresh(f"{gate.value}::gate_up")
            nodes.append(helper.make_node("Add", [mm_out, bias], [packed_value],
                                          name=names.fresh(f"{gate.add.name}::gate_up")))
        split_name = names.fresh(f"{gate.matmul.name}::gate_up_split")
        if old_opset:
            nodes.append(helper.make_node("Split", [packed_value], [gate.value, up.value],
                                          axis=-1, split=[width, width], name=split_name))
        else:
            sizes = names.fresh(f"{weight}::split")
            new_inits.append(numpy_helper.from_array(np.array([width, width], np.int64), sizes))
            nodes.append(helper.make_node("Split", [packed_value, sizes],
                                          [gate.value, up.value], axis=-1, name=split_name))
        old = [p for proj in (gate, up) for p in (proj.matmul, proj.add) if p is not None]
        inserts[min(old, key=lambda n: idx.position[n.name]).name] = nodes
        removed_values |= {p.matmul.output[0] for p in (gate, up) if p.add is not None}
        for value in dict.fromkeys((mm_out, packed_value)):
            info = packed_info(model, gate.value, value, 2 * width)
            if info is not None:
                out.graph.value_info.append(info)
        packed.append(PackedGateUp(tuple(n.name for n in old), tuple(n.name for n in nodes),
                                   weight, bias))
    gone = {name for p in packed for name in p.replaced}
    old_weights = {w for pair in pairs for p in pair for w in (p.weight, p.bias) if w}
    splice(out, inserts, gone, old_weights, new_inits, removed_values)
    return GateUpResult(out, tuple(packed))
