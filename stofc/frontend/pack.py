"""Pack three parallel Q, K, V projections into one, before analysis (GPT-2's c_attn form).

BERT-like exports project Q, K and V with three MatMul (+ bias Add) nodes on
the same input; the package rewrite runs them as ONE [K, 3N] GEMM
(:mod:`stofc.lower.rewrite`, ``pack_qkv``). Packing them in the ONNX graph
first makes the plan, the tuner and the rewrite see that one GEMM: one ``qkv``
gemm segment per layer with ``n0 = 3N``, as GPT-2's c_attn already gives.

Contract of :func:`pack_projections` (on a canonicalized model, see
:func:`stofc.frontend.load.canonicalize`):

* For every attention block :func:`~stofc.frontend.attention.find_attention`
  matches whose Q, K and V are three distinct values, each produced by
  ``MatMul(x, W)`` with the same ``x`` and initializer weights of one shape
  ``[K, N]`` with ``N = H*D``, each followed by an ``Add`` of an initializer
  bias of shape ``[N]`` (all three) or by no Add (all three), the three
  projections are replaced by ``MatMul(x, W_qkv) -> Add(b_qkv) ->
  Split(axis=-1, [N, N, N])`` where ``W_qkv = [W_q | W_k | W_v]`` (``[K, 3N]``)
  and ``b_qkv = [b_q | b_k | b_v]``, concatenated in the order the *attention*
  uses them (Q from Q·Kᵀ's left operand, K its right, V from P·V), not graph
  order. The Split's three outputs keep the old projection outputs' names, so
  every consumer reads the same values; graph inputs and outputs are unchanged.
  The function is the same: each output column is the same dot product and the
  same bias add (ORT's CPU MatMul may sum in another order: fp32 rounding).
* Skipped (left as they are, the rewrite's ``pack_qkv`` still packs them at
  package time): weights that are not plain ``[K, N]`` initializers (a
  Transpose, Cast or Constant in front, a graph input overriding the
  initializer, ``Gemm`` nodes, a Reshape to 2-D around the GEMM), biases on
  only some projections or not of shape ``[N]``, different inputs or weight
  shapes, ``N != H*D``, a MatMul result read by anything but its bias Add, a
  projection output read outside its attention block (Shape/Size readers
  aside) or a graph output, blocks already packed, and models of opset < 13
  (whose Split takes its sizes as an attribute).
* New nodes sit where the first replaced node was (topological order holds);
  old weights no other node reads are dropped; the packed values get
  ``value_info`` derived from the Q projection's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from stofc.frontend.attention import find_attention
from stofc.frontend.graph import GraphIndex
from stofc.frontend.load import opset_of
from stofc.frontend.types import AttentionBlock


@dataclass(frozen=True)
class PackedProjection:
    """One block's Q, K, V projections, now one MatMul (+ Add) and a Split."""

    replaced: tuple[str, ...]   # the removed MatMul/Add node names (Q, K, V order)
    nodes: tuple[str, ...]      # the new MatMul, Add (when biased), Split
    weight: str                 # the new [K, 3N] initializer
    bias: str | None            # the new [3N] initializer


@dataclass(frozen=True)
class PackResult:
    """The packed model, what was packed, and why other blocks were not."""

    model: onnx.ModelProto
    packed: tuple[PackedProjection, ...]
    skipped: tuple[tuple[str, str], ...]   # (the block's Q input, the reason)


class _Skip(Exception):
    pass


@dataclass(frozen=True)
class _Projection:
    value: str                    # the projection output (attention reads it)
    matmul: onnx.NodeProto
    add: onnx.NodeProto | None
    weight: str
    bias: str | None


def _projection(idx: GraphIndex, block: AttentionBlock, value: str, role: str,
                overridden: set[str]) -> _Projection:
    if idx.is_graph_output(value):
        raise _Skip(f"the {role} projection is a graph output")
    inside = set(block.nodes)
    if any(u.name not in inside for u in idx.data_users(value)):
        raise _Skip(f"the {role} projection is read outside the attention block")
    node = idx.produced_by(value)
    add = bias = None
    if node is not None and node.op_type == "Add":
        add = node
        pair = [(a, b) for a, b in (node.input, node.input[::-1])
                if b in idx.initializers and b not in overridden
                and idx.produced_by(a, "MatMul") is not None]
        if len(pair) != 1:
            raise _Skip(f"the {role} projection's Add is not MatMul + initializer bias")
        mm_out, bias = pair[0]
        if idx.is_graph_output(mm_out) or len(idx.users(mm_out)) != 1:
            raise _Skip(f"the {role} MatMul result is read besides its bias Add")
        node = idx.produced_by(mm_out)
    if node is None or node.op_type != "MatMul":
        raise _Skip(f"the {role} projection is not a MatMul (+ bias Add)")
    weight = node.input[1]
    if weight not in idx.initializers or weight in overridden:
        raise _Skip(f"the {role} weight is not a plain initializer")
    if idx.initializers[weight].data_location == onnx.TensorProto.EXTERNAL:
        raise _Skip(f"the {role} weight's external data is not loaded")
    return _Projection(value, node, add, weight, bias)


def _match(idx: GraphIndex, block: AttentionBlock, overridden: set[str]
           ) -> tuple[_Projection, ...]:
    values = (block.q_input, block.k_input, block.v_input)
    if block.packed_qkv or len(set(values)) != 3:
        raise _Skip("Q, K and V are not three distinct values (already packed)")
    projs = tuple(_projection(idx, block, v, r, overridden) for v, r in zip(values, "QKV",
                                                                           strict=True))
    if len({p.matmul.name for p in projs}) != 3:
        raise _Skip("Q, K and V share a MatMul")
    if len({p.matmul.input[0] for p in projs}) != 1:
        raise _Skip("Q, K and V are projected from different inputs")
    weights = [idx.initializers[p.weight] for p in projs]
    dims = {tuple(w.dims) for w in weights}
    if len(dims) != 1 or len(next(iter(dims))) != 2:
        raise _Skip(f"the weights' shapes differ or are not [K, N]: {sorted(dims)}")
    n = weights[0].dims[1]
    if n != block.hidden_size:
        raise _Skip(f"N = {n} is not heads x head_dim = {block.hidden_size}")
    if len({w.data_type for w in weights}) != 1:
        raise _Skip("the weights' element types differ")
    biases = [p.bias for p in projs]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise _Skip("only some projections have a bias")
    for b in biases:
        if b is not None and (list(idx.initializers[b].dims) != [n]
                              or idx.initializers[b].data_type != weights[0].data_type):
            raise _Skip(f"a bias is not a [{n}] tensor of the weights' type")
    return projs


class FreshNames:
    """Names not yet taken in a model (nodes, values, initializers, inputs)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        g = model.graph
        self.taken = {n.name for n in g.node} | {t.name for t in g.initializer} | {
            v for n in g.node for v in (*n.input, *n.output)} | {i.name for i in g.input}

    def fresh(self, base: str) -> str:
        """``base``, or ``base_<k>`` with the first free k; taken from now on."""
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name


def concat_initializers(idx: GraphIndex, names: list[str], axis: int, out: str
                        ) -> onnx.TensorProto:
    """The initializers ``names`` concatenated on ``axis``, as initializer ``out``."""
    arrays = [numpy_helper.to_array(idx.initializers[n]) for n in names]
    return numpy_helper.from_array(np.ascontiguousarray(np.concatenate(arrays, axis=axis)), out)


def packed_info(model: onnx.ModelProto, like: str, name: str, width: int
                ) -> onnx.ValueInfoProto | None:
    """``like``'s value_info renamed ``name`` with last dimension ``width`` (None: none)."""
    for vi in model.graph.value_info:
        if vi.name == like and vi.type.tensor_type.HasField("shape"):
            out = onnx.ValueInfoProto()
            out.CopyFrom(vi)
            out.name = name
            dims = out.type.tensor_type.shape.dim
            if dims:
                dims[-1].Clear()
                dims[-1].dim_value = width
            return out
    return None


def pack_projections(model: onnx.ModelProto) -> PackResult:
    """``model`` with every packable block's Q, K, V projections packed (module doc).

    ``model`` itself is not changed; the result is a copy (or ``model`` when
    nothing was packed).
    """
    idx = GraphIndex(model)
    if opset_of(model) < 13:  # Split's sizes are an attribute there: not written, not packed
        return PackResult(model, (), (("", f"opset {opset_of(model)} < 13"),))
    overridden = {i.name for i in model.graph.input} & set(idx.initializers)
    blocks, _ = find_attention(idx)
    matches, skipped = [], []
    claimed: set[str] = set()
    for block in blocks:
        try:
            projs = _match(idx, block, overridden)
        except _Skip as why:
            skipped.append((block.q_input, str(why)))
            continue
        owned = {p.matmul.name for p in projs} | {p.add.name for p in projs if p.add}
        if owned & claimed:
            continue  # two Softmax matched one block
        claimed |= owned
        matches.append(projs)
    if not matches:
        return PackResult(model, (), tuple(skipped))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = FreshNames(out)
    graph = out.graph
    packed, new_inits, removed_values = [], [], set()
    inserts: dict[str, list[onnx.NodeProto]] = {}
    for projs in matches:
        q = projs[0]
        x, n = q.matmul.input[0], int(idx.initializers[q.weight].dims[1])
        weight = names.fresh(f"{q.weight}::qkv")
        new_inits.append(concat_initializers(idx, [p.weight for p in projs], 1, weight))
        mm_out = names.fresh(f"{q.matmul.output[0]}::qkv")
        nodes = [helper.make_node("MatMul", [x, weight], [mm_out],
                                  name=names.fresh(f"{q.matmul.name}::qkv"))]
        packed_value, bias = mm_out, None
        if q.add is not None:
            bias = names.fresh(f"{q.bias}::qkv")
            new_inits.append(concat_initializers(idx, [str(p.bias) for p in projs], 0, bias))
            packed_value = names.fresh(f"{q.value}::qkv")
            nodes.append(helper.make_node("Add", [mm_out, bias], [packed_value],
                                          name=names.fresh(f"{q.add.name}::qkv")))
        outs = [p.value for p in projs]
        sizes = names.fresh(f"{weight}::split")
        new_inits.append(numpy_helper.from_array(np.array([n, n, n], np.int64), sizes))
        nodes.append(helper.make_node("Split", [packed_value, sizes], outs, axis=-1,
                                      name=names.fresh(f"{q.matmul.name}::qkv_split")))
        old = [p.matmul for p in projs] + [p.add for p in projs if p.add is not None]
        first = min(old, key=lambda node: idx.position[node.name])
        inserts[first.name] = nodes
        removed_values |= {p.matmul.output[0] for p in projs if p.add is not None}
        for value in {mm_out, packed_value}:
            info = packed_info(model, q.value, value, 3 * n)
            if info is not None:
                graph.value_info.append(info)
        packed.append(PackedProjection(
            tuple(node.name for p in projs for node in (p.matmul, p.add) if node is not None),
            tuple(node.name for node in nodes), weight, bias))
    gone = {name for p in packed for name in p.replaced}
    old_weights = {w for projs in matches for p in projs for w in (p.weight, p.bias) if w}
    splice(out, inserts, gone, old_weights, new_inits, removed_values)
    return PackResult(out, tuple(packed), tuple(skipped))


def splice(out: onnx.ModelProto, inserts: dict[str, list[onnx.NodeProto]], gone: set[str],
           old_weights: set[str], new_inits: list[onnx.TensorProto],
           removed_values: set[str]) -> None:
    """Edit ``out`` in place: ``inserts[name]`` go before node ``name``, the nodes named in
    ``gone`` go away, initializers in ``old_weights`` no node reads any more are dropped,
    ``new_inits`` are added and ``value_info`` of ``removed_values`` is dropped."""
    graph = out.graph
    kept: list[onnx.NodeProto] = []
    for node in graph.node:
        kept.extend(inserts.get(node.name, ()))
        if node.name not in gone:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    used = {i for node in kept for i in node.input} | subgraph_reads(kept) | {
        o.name for o in graph.output}
    inits = [t for t in graph.initializer if t.name not in old_weights or t.name in used]
    del graph.initializer[:]
    graph.initializer.extend([*inits, *new_inits])
    infos = [vi for vi in graph.value_info if vi.name not in removed_values]
    del graph.value_info[:]
    graph.value_info.extend(infos)


def subgraph_reads(nodes: list[onnx.NodeProto]) -> set[str]:
    """Outer-scope names read inside the If/Loop/Scan bodies of ``nodes``."""
    names: set[str] = set()
    for node in nodes:
        for attr in node.attribute:
            for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                names |= {i for sub in g.node for i in sub.input}
                names |= subgraph_reads(list(g.node))
    return names
