"""Rewrite the canonicalized model so every planned segment runs as ``ai.stofc`` nodes.

Contract (the ops are those of ``cuda/ort/OPS.md``):

* Every ONNX node of every planned layer chain is removed; each segment is
  emitted as ai.stofc nodes producing the segment's output values. Everything
  else (embeddings, masks, pooler, blocks stofc does not handle) is unchanged.
* Fused ops run in the plan's dtype (float16 or bfloat16). A value entering a
  fused op from an unfused node gets one ``Cast`` to the dtype; a fused result
  read by an unfused node or a graph output gets one ``Cast`` back to its
  original type, under its original name: graph inputs and outputs keep their
  names, shapes and types. Weights the fused ops read are stored converted to
  the dtype (GEMM weights as ``[K, N]``).
* Families map to ops as follows (what :class:`EmittedSegment` records):
  ``attention`` -> SparseAttention; ``gemm`` -> FusedGemm; ``gemm_norm`` ->
  FusedGemm + AddLayerNorm; ``gemm_gemm`` -> FusedGemm + FusedGemm
  (+ AddLayerNorm); ``add_norm`` -> AddLayerNorm. Parts without an ai.stofc op
  (a ReLU activation, a bias or activation in a memory-bound segment, a
  residual add without a norm and without a GEMM) are emitted as standard ONNX
  ops computed in float32 between Casts, and recorded as such.
* Q, K, V packing (``pack_qkv``, the default): when a layer's Q, K and V are
  three FusedGemm nodes reading the same ``x`` with the same K, N = H*D for Q and
  Hkv*D for K and V, no activation and no residual, whose results only that layer's
  SparseAttention reads (as q, k, v), or only the Rotary in front of it (a RoPE
  stofc runs), they become ONE FusedGemm whose weight is
  ``[K, (H + 2 Hkv) D]`` = [Wq | Wk | Wv] and bias = [bq | bk | bv] (a missing
  bias is zeros; none at all, no bias), its result fed to the reader's
  ``q`` with ``k`` and ``v`` given as ``""`` (OPS.md, packed QKV). A block the
  frontend found packed already (one QKV GEMM) feeds its value the same way
  instead of being split. The three segments' :class:`EmittedSegment` list the
  packed node and say so in ``note``; so does the attention segment.
  ``pack_qkv=False`` keeps three FusedGemm nodes (and the Split).
* Key padding is prepared once per mask value: the first SparseAttention that
  reads a ``key_padding_mask`` value gets one ``KeyPrep`` node (OPS.md) before
  it, and every SparseAttention reading that value takes KeyPrep's result as
  its input 5 ``key_state`` (bias slot ``""`` when absent), so the CUDA twin
  launches the key-prep kernel once per run instead of once per layer. That
  first attention segment lists the KeyPrep node and ``ai.stofc:KeyPrep`` in
  its :class:`EmittedSegment` and says so in ``note``.
* bfloat16 packages keep LayerNorm's gamma / beta float32 and never round the
  sum a LayerNorm normalises: a FusedGemm read only by an AddLayerNorm writes
  ``x@W + b`` in float32 and the norm adds the residual
  (:mod:`stofc.lower.prenorm`); the residual stream of pre-norm layers (a
  GEMM-plus-residual sum that a norm and later residual adds read, a norm's
  ``sum`` output) is formed and kept in float32 by ONNX ``Add`` nodes, the norm
  adding the residual itself (:mod:`stofc.lower.stream`). float16 packages are
  unchanged.
* The embedding runs in the dtype (:mod:`stofc.lower.embed`): where a value
  entering a fused op through a Cast is the sum of Gathers from float32 tables
  (optionally under a last-axis LayerNormalization) and nothing else reads it,
  the tables are stored in the dtype, the sum is ONNX Adds in the dtype, the
  norm an AddLayerNorm, and the Cast is gone. bfloat16 packages do so only
  where no Add remains (the CPU EP has no bfloat16 Add). Recorded in the note of
  the first segment reading it.
* The result is topologically sorted, dead nodes and unused initializers are
  dropped, and the ``ai.stofc`` opset (version 1) is imported. A value left
  without a producer is a :class:`~stofc.errors.PlanError` (a stofc bug), never
  a broken file.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
from onnx import TensorProto, helper

from stofc.errors import PlanError
from stofc.frontend.graph import GraphIndex
from stofc.frontend.types import ModelGraph
from stofc.lower.embed import embed_in_dtype
from stofc.lower.emit import (
    DOMAIN,
    DOMAIN_VERSION,
    AttentionBinding,
    EmittedSegment,
    Emitter,
    bits_tensor,
    tensor_bits,
)
from stofc.lower.emitters import emit_segment
from stofc.lower.prenorm import keep_pre_norm_fp32
from stofc.lower.stream import keep_stream_fp32
from stofc.plan.plan import Plan

__all__ = ["DOMAIN", "AttentionBinding", "EmittedSegment", "float_type", "rewrite_model"]


def rewrite_model(graph: ModelGraph, plan: Plan, kernels: dict[tuple[int, int], str],
                  attention: dict[int, AttentionBinding], *, pack_qkv: bool = True
                  ) -> tuple[onnx.ModelProto, tuple[EmittedSegment, ...]]:
    """The package's model.onnx and how each segment was emitted (see the module doc).

    ``kernels[(layer, ordinal)]`` is the ``kernel`` attribute of the segment's
    nodes; ``attention[layer]`` the SparseAttention node's other inputs;
    ``pack_qkv`` packs Q, K, V into one GEMM where it can (module doc).
    """
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    idx = GraphIndex(model)
    em = Emitter(idx, plan.dtype, graph.opset)
    removed: set[str] = set()
    emitted = []
    for layer_plan in plan.layers:
        layer = graph.layers[layer_plan.index]
        for op in layer.chain:
            if len(op.outputs) > 1:  # the plan's dataflow knows one result per operator
                raise PlanError(f"layer {layer.index} operator #{op.index} ({op.kind.value}) "
                                f"produces {len(op.outputs)} values read elsewhere "
                                f"({', '.join(op.outputs)}); the fusion plan cannot represent it",
                                hint="report the model to stofc (e.g. a clamp inside a norm)")
        removed |= {n for op in layer.chain for n in op.nodes}
        for seg in layer_plan.segments:
            emitted.append(emit_segment(em, graph, seg, kernels.get((seg.layer, seg.ordinal), ""),
                                        attention.get(seg.layer), packed_q=pack_qkv))
    removed -= em.kept                      # segments the model's own nodes run (ONNX Runtime)
    removed = _restore_needed(list(model.graph.node), removed, em.fused, em.nodes,
                              set(idx.graph_outputs))
    kept = [n for n in model.graph.node if n.name not in removed]
    needed, live = _live_reads([*kept, *em.nodes], em.fused, set(idx.graph_outputs))
    kept = [n for n in kept if n.name in live]   # e.g. a Shape of a value the rewrite removed
    if pack_qkv:
        emitted = _pack_qkv(em, emitted, needed)
    emitted = keep_pre_norm_fp32(em, emitted, needed)
    emitted = keep_stream_fp32(em, emitted, needed)
    kept, emitted = embed_in_dtype(em, kept, emitted,
                                   set(idx.graph_outputs) | _subgraph_inputs(kept),
                                   plan.max_seq_len)
    for value, twin in em.fused.items():
        if value in needed:
            em.node("Cast", [twin], [value], stem="cast_out",
                    to=idx.elem_type(value) or float_type(idx))
    nodes = _topological([*kept, *em.nodes], set(idx.graph_inputs) | set(idx.initializers)
                         | set(em.inits))
    nodes = _live(nodes, set(idx.graph_outputs))
    used = {i for n in nodes for i in n.input if i} | _subgraph_inputs(nodes)
    inits = [t for t in model.graph.initializer if t.name in used]
    inits += [t for name, t in em.inits.items() if name in used]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    del model.graph.initializer[:]
    model.graph.initializer.extend(inits)
    del model.graph.value_info[:]
    inputs = [i for i in model.graph.input if i.name not in idx.initializers or i.name in used]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return model, tuple(emitted)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _qkv_gemms(em: Emitter, sa: onnx.NodeProto, producer: dict[str, onnx.NodeProto],
               readers: dict[str, int], read_outside: set[str]
               ) -> tuple[onnx.NodeProto, ...] | None:
    """The Q, K, V FusedGemm nodes that ``sa`` (a SparseAttention or a Rotary) reads, when
    they can be packed (module doc), else None."""
    qkv = list(sa.input[:3])
    if len(qkv) < 3 or "" in qkv or len(set(qkv)) < 3:
        return None
    heads, dim = int(_attr(sa, "num_heads", 0)), int(_attr(sa, "head_dim", 0))
    kv = int(_attr(sa, "kv_num_heads", heads))
    gemms: list[onnx.NodeProto] = []
    ks = set()
    for value, width in zip(qkv, (heads * dim, kv * dim, kv * dim), strict=True):
        node = producer.get(value)
        if node is None or node.domain != DOMAIN or node.op_type != "FusedGemm" \
                or list(node.output) != [value] or readers.get(value) != 1 \
                or value in read_outside or _text(_attr(node, "activation", "none")) != "none" \
                or any(node.input[3:]) or node.input[0] != (gemms or [node])[0].input[0]:
            return None
        gemms.append(node)
        w = em.inits.get(node.input[1])
        b = em.inits.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if w is None or len(w.dims) != 2 or w.dims[1] != width or w.data_type != em.elem:
            return None
        if len(node.input) > 2 and node.input[2] and (
                b is None or list(b.dims) != [width] or b.data_type != em.elem):
            return None
        ks.add(w.dims[0])
    return tuple(gemms) if len(ks) == 1 else None


def _pack_qkv(em: Emitter, emitted: list[EmittedSegment], needed: set[str]
              ) -> list[EmittedSegment]:
    """Replace each packable Q, K, V FusedGemm triple by one packed node (module doc).

    ``needed`` holds the original values read outside the fused ops (unfused
    nodes, graph outputs): a Q, K or V result among them is not packed. The triple's
    reader is a SparseAttention, or the Rotary in front of one (a RoPE stofc runs).
    """
    producer = {o: n for n in em.nodes for o in n.output if o}
    readers: dict[str, int] = {}
    for node in em.nodes:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    read_outside = {twin for value, twin in em.fused.items() if value in needed}
    layer_of = {name: e.layer for e in emitted for name in e.nodes}
    packed_as: dict[str, str] = {}   # old FusedGemm name -> packed node name
    notes: dict[str, str] = {}       # node name -> the note of the segment holding it
    for sa in [n for n in em.nodes if n.domain == DOMAIN
               and n.op_type in ("SparseAttention", "Rotary")]:
        gemms = _qkv_gemms(em, sa, producer, readers, read_outside)
        if gemms is None:
            continue
        layer = layer_of[sa.name]
        k_dim = em.inits[gemms[0].input[1]].dims[0]
        widths = [int(em.inits[g.input[1]].dims[1]) for g in gemms]
        weight = f"stofc/layer{layer}.qkv.weight::stofc_{em.tag}_kn"
        em.inits[weight] = bits_tensor(np.concatenate(
            [tensor_bits(em.inits[g.input[1]]) for g in gemms], axis=1), em.elem, weight)
        inputs = [gemms[0].input[0], weight]
        if any(len(g.input) > 2 and g.input[2] for g in gemms):
            bias = f"stofc/layer{layer}.qkv.bias::stofc_{em.tag}"
            em.inits[bias] = bits_tensor(np.concatenate(
                [tensor_bits(em.inits[g.input[2]]) if len(g.input) > 2 and g.input[2]
                 else np.zeros(n, np.uint16) for g, n in zip(gemms, widths, strict=True)]),
                em.elem, bias)
            inputs.append(bias)
        name, out = em.name("FusedGemm_qkv"), f"stofc/layer{layer}.qkv::stofc_{em.tag}.out"
        node = helper.make_node("FusedGemm", inputs, [out], name=name, domain=DOMAIN,
                                activation="none", residual_after_activation=1,
                                kernel=_text(_attr(gemms[0], "kernel", "")))
        at = min(em.nodes.index(g) for g in gemms)
        em.nodes[at:at] = [node]
        for g in gemms:
            em.nodes.remove(g)
            packed_as[g.name] = name
        for value in list(em.fused):
            if em.fused[value] in sa.input[:3]:
                del em.fused[value]
        sa.input[0], sa.input[1], sa.input[2] = out, "", ""
        gemm_segs = sorted({(layer_of[g.name], e.ordinal) for g in gemms for e in emitted
                            if g.name in e.nodes})
        notes[name] = (f"Q|K|V packed: {name} computes segments "
                       f"{', '.join(str(o) for _, o in gemm_segs)} of layer {layer} as one "
                       f"FusedGemm (w [{k_dim}, {sum(widths)}] = [Wq | Wk | Wv])")
        notes[sa.name] = f"q is {name}'s packed [Q | K | V] result; k, v omitted (OPS.md)"
    renamed: list[EmittedSegment] = []
    for e in emitted:
        nodes = tuple(dict.fromkeys(packed_as.get(n, n) for n in e.nodes))
        extra = [notes[n] for n in nodes if n in notes]
        if nodes != e.nodes or extra:
            e = replace(e, nodes=nodes, note="; ".join([e.note, *extra] if e.note else extra))
        renamed.append(e)
    return renamed


def float_type(idx: GraphIndex) -> int:
    """The model's float type where shape inference left a value untyped: its weights' type."""
    counts: dict[int, int] = {}
    for t in idx.initializers.values():
        if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16):
            counts[t.data_type] = counts.get(t.data_type, 0) + 1
    return max(counts, key=lambda k: counts[k]) if counts else TensorProto.FLOAT


def _restore_needed(nodes: list[onnx.NodeProto], removed: set[str], fused: dict[str, str],
                    emitted: list[onnx.NodeProto], outputs: set[str]) -> set[str]:
    """Keep removed nodes whose results live unfused nodes still read (shared shape/bias
    helpers). A reader that computes nothing a graph output needs (a Shape of a rotated K
    feeding a mask only the removed attention read) restores nothing."""
    removed = set(removed)
    while True:
        kept = [n for n in nodes if n.name not in removed]
        reads, _ = _live_reads([*kept, *emitted], fused, outputs)
        back = {n.name for n in nodes if n.name in removed
                and any(o in reads and o not in fused for o in n.output)}
        if not back:
            return removed
        removed -= back


def _live_reads(nodes: list[onnx.NodeProto], fused: dict[str, str], outputs: set[str]
                ) -> tuple[set[str], set[str]]:
    """The values the nodes contributing to a graph output read (graph outputs included),
    and those nodes' names: each value's producer among ``nodes``, a fused value's being
    the node writing its dtype twin (``fused``), which a Cast back provides to unfused
    readers."""
    producer = {o: n for n in nodes for o in n.output if o}
    for value, twin in fused.items():
        if twin in producer:
            producer.setdefault(value, producer[twin])
    reads, stack, seen = set(outputs), list(outputs), set()
    while stack:
        node = producer.get(stack.pop())
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        ins = {i for i in node.input if i} | _subgraph_inputs([node])
        reads |= ins
        stack.extend(ins)
    return reads, seen


def _subgraph_inputs(nodes: list[onnx.NodeProto]) -> set[str]:
    """Names read inside If/Loop/Scan bodies (outer-scope values)."""
    names: set[str] = set()
    for node in nodes:
        for attr in node.attribute:
            for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                for sub in g.node:
                    names |= {i for i in sub.input if i}
                names |= _subgraph_inputs(list(g.node))
    return names


def _topological(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """Kahn's order, stable in the given order; a missing producer is a PlanError."""
    have = set(available) | {""}
    pending = list(nodes)
    ordered: list[onnx.NodeProto] = []
    while pending:
        rest = []
        for node in pending:
            needs = set(node.input) | _subgraph_inputs([node])
            if needs <= have:
                ordered.append(node)
                have |= set(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            producers = {o for n in nodes for o in n.output}
            missing = sorted({i for n in rest for i in n.input if i and i not in have
                              and i not in producers})
            what = f"value {missing[0]!r} has no producer" if missing else "a cycle"
            raise PlanError(f"rewriting the model to ai.stofc ops left {what} "
                            f"({len(rest)} nodes unplaced, e.g. {rest[0].name!r})",
                            hint="this is a stofc bug; report it with the model")
        pending = rest
    return ordered


def _live(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """Nodes that contribute to a graph output."""
    need = set(outputs)
    keep = []
    for node in reversed(nodes):
        if any(o in need for o in node.output if o):
            keep.append(node)
            need |= {i for i in node.input if i} | _subgraph_inputs([node])
    return list(reversed(keep))
