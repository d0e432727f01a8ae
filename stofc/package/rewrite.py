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
* The result is topologically sorted, dead nodes and unused initializers are
  dropped, and the ``ai.stofc`` opset (version 1) is imported. A value left
  without a producer is a :class:`~stofc.errors.PlanError` (a stofc bug), never
  a broken file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from stofc.errors import PlanError
from stofc.frontend.graph import GraphIndex
from stofc.frontend.types import AttentionBlock, ModelGraph
from stofc.plan.plan import Plan, Segment

DOMAIN = "ai.stofc"
DOMAIN_VERSION = 1
ELEM = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
_TAG = {"float16": "f16", "bfloat16": "bf16"}
_OPS_FOR_ACT = ("none", "gelu_erf", "gelu_tanh")


@dataclass(frozen=True)
class AttentionBinding:
    """What a layer's SparseAttention node reads besides Q, K and V."""

    layer: int
    mask_file: str                 # relative to the package directory
    kernel: str                    # "kernels/FILE.cubin:ENTRY"
    key_padding_mask: str | None   # a [B, S] graph input (nonzero = real token)
    bias: str | None               # an additive [B|1, H|1, S, S] value (T5, ALiBi)
    launch: tuple[tuple[str, int], ...] = ()   # block_threads, blocks_per_tile_row, smem_bytes


@dataclass(frozen=True)
class EmittedSegment:
    """How one plan segment was written into model.onnx."""

    layer: int
    ordinal: int
    family: str
    ops: tuple[str, ...]     # e.g. ("ai.stofc:FusedGemm", "ai.stofc:AddLayerNorm")
    nodes: tuple[str, ...]   # names of the emitted nodes
    note: str = ""

    def to_dict(self) -> dict:
        return {"layer": self.layer, "ordinal": self.ordinal, "family": self.family,
                "ops": list(self.ops), "nodes": list(self.nodes), "note": self.note}


def attention_inputs(block: AttentionBlock, graph: ModelGraph) -> tuple[str | None, str | None]:
    """``(key_padding_mask, bias)`` for a block, or a PlanError saying why it cannot run."""
    kpm = bias = None
    inputs = {v.name: v for v in graph.inputs}
    for form in block.mask_form.split("+"):
        if form == "none":
            continue
        if form in ("additive", "boolean_where", "boolean"):
            if block.mask_source is None and block.causal_in_graph:
                continue  # a constant causal mask: ANDed into the structured mask instead
            src = inputs.get(block.mask_source or "")
            if src is None or len(src.shape) != 2:
                raise PlanError(
                    f"layer {block.layer}: the attention mask ({form}) does not come from a "
                    f"[batch, sequence] padding input, so SparseAttention cannot take it",
                    hint="export the model with a 2-D attention_mask input")
            kpm = src.name
        elif form in ("relative_bias", "bias"):
            if not block.bias_input:
                raise PlanError(f"layer {block.layer}: an additive score bias without a value",
                                hint="this is a stofc bug; report it")
            bias = block.bias_input
        else:
            raise PlanError(f"layer {block.layer}: attention mask form {form!r} is not supported "
                            "by the package writer", hint="report the model to stofc")
    if block.rotary:
        raise PlanError(f"layer {block.layer}: rotary position embeddings inside attention are "
                        "not supported by the package writer yet",
                        hint="compile a model without RoPE (BERT, GPT-2, ViT, T5)")
    return kpm, bias


class _Emitter:
    """Builds the new nodes: value name maps, Casts, converted weights."""

    def __init__(self, idx: GraphIndex, dtype: str, opset: int) -> None:
        self.idx, self.dtype, self.opset = idx, dtype, opset
        self.elem, self.tag = ELEM[dtype], _TAG[dtype]
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, TensorProto] = {}
        self.fused: dict[str, str] = {}    # original value -> its dtype twin, made by a fused op
        self.casts: dict[str, str] = {}    # unfused value -> its dtype twin (Cast)
        self.count = 0

    def name(self, stem: str) -> str:
        self.count += 1
        return f"stofc/{stem}_{self.count}"

    def node(self, op: str, inputs: list[str], outputs: list[str], *, domain: str = "",
             stem: str = "", **attrs) -> onnx.NodeProto:
        node = helper.make_node(op, inputs, outputs, name=self.name(stem or op), domain=domain,
                                **attrs)
        self.nodes.append(node)
        return node

    def half(self, value: str) -> str:
        """``value`` in the dtype: the fused twin, the value itself, or a Cast of it."""
        if value in self.fused:
            return self.fused[value]
        if self.idx.elem_type(value) == self.elem:
            return value
        if value not in self.casts:
            twin = f"{value}::stofc_{self.tag}"
            self.node("Cast", [value], [twin], stem="cast_in", to=self.elem)
            self.casts[value] = twin
        return self.casts[value]

    def output(self, value: str) -> str:
        """The dtype name a fused op writes for ``value`` (Cast back later if read outside).

        Unique per write: when the plan names one (virtual) value for two
        results, each reader gets the latest write before it, as the plan's
        sequential order means.
        """
        twin = f"{value}::stofc_{self.tag}.out"
        if value in self.fused:
            twin = f"{twin}{self.count}"
            self.count += 1
        self.fused[value] = twin
        return twin

    def fp32(self, value_dt: str) -> str:
        out = f"{value_dt}::f32_{self.count + 1}"
        self.node("Cast", [value_dt], [out], stem="cast_f32", to=TensorProto.FLOAT)
        return out

    def weight(self, name: str, *, transpose: bool = False) -> str:
        """The initializer ``name`` in the dtype (transposed for NK GEMM weights)."""
        key = f"{name}::stofc_{self.tag}{'_kn' if transpose else ''}"
        if key not in self.inits:
            array = self.idx.const(name)
            if array is None:
                raise PlanError(f"weight {name!r} is not a constant",
                                hint="stofc fuses GEMMs with constant weights only")
            array = np.asarray(array, dtype=np.float32)
            if transpose:
                array = array.T
            self.inits[key] = to_tensor(np.ascontiguousarray(array), self.dtype, key)
        return key

    def weight_f32(self, name: str) -> str:
        key = f"{name}::stofc_f32"
        if key not in self.inits:
            self.inits[key] = numpy_helper.from_array(
                np.asarray(self.idx.const(name), dtype=np.float32).reshape(-1), key)
        return key


def to_tensor(array: np.ndarray, dtype: str, name: str) -> TensorProto:
    """A float array as a float16 or bfloat16 (round to nearest even) initializer."""
    if dtype == "float16":
        return numpy_helper.from_array(array.astype(np.float16), name)
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    tensor = TensorProto(name=name, data_type=TensorProto.BFLOAT16, dims=list(array.shape))
    tensor.raw_data = bits.tobytes()
    return tensor


def _emit_fp32_tail(em: _Emitter, x_dt: str, out_name: str, *, bias: str | None, act: str,
                    residual: str | None) -> tuple[str, ...]:
    """bias -> act -> residual in float32 ONNX ops, the result written in the dtype."""
    ops: list[str] = []
    v = em.fp32(x_dt)
    if bias:
        v2 = em.name("bias_f32")
        em.node("Add", [v, em.weight_f32(bias)], [v2])
        v, ops = v2, [*ops, "Add"]
    if act != "none":
        v2 = em.name("act_f32")
        if act == "relu":
            em.node("Relu", [v], [v2])
            ops.append("Relu")
        else:
            _gelu_f32(em, v, v2, tanh=act == "gelu_tanh")
            ops.append("Gelu(decomposed)")
        v = v2
    if residual:
        v2 = em.name("res_f32")
        em.node("Add", [v, em.fp32(em.half(residual))], [v2])
        v, ops = v2, [*ops, "Add"]
    em.node("Cast", [v], [out_name], stem="cast_out", to=em.elem)
    return tuple(f"onnx:{o}" for o in ops)


def _gelu_f32(em: _Emitter, x: str, out: str, *, tanh: bool) -> None:
    def const(value: float) -> str:
        name = em.name("c")
        em.inits[name] = numpy_helper.from_array(np.array(value, np.float32), name)
        return name

    if tanh:
        cube = em.name("g")
        em.node("Mul", [x, x], [cube + "a"])
        em.node("Mul", [cube + "a", x], [cube])
        inner = em.name("g")
        em.node("Mul", [cube, const(0.044715)], [inner + "a"])
        em.node("Add", [x, inner + "a"], [inner + "b"])
        em.node("Mul", [inner + "b", const(math.sqrt(2 / math.pi))], [inner])
        t = em.name("g")
        em.node("Tanh", [inner], [t])
    else:
        t = em.name("g")
        em.node("Div", [x, const(math.sqrt(2.0))], [t + "a"])
        em.node("Erf", [t + "a"], [t])
    one = em.name("g")
    em.node("Add", [t, const(1.0)], [one])
    half = em.name("g")
    em.node("Mul", [x, one], [half])
    em.node("Mul", [half, const(0.5)], [out])


def _gemm_node(em: _Emitter, x_dt: str, w: str, b: str | None, residual: str | None,
               act: str, out: str, kernel: str, layout: str) -> str:
    inputs = [x_dt, em.weight(w, transpose=layout == "NK"), em.weight(b) if b else ""]
    if residual:
        inputs.append(em.half(residual))
    while inputs and inputs[-1] == "":
        inputs.pop()
    em.node("FusedGemm", inputs, [out], domain=DOMAIN, stem="FusedGemm", activation=act,
            residual_after_activation=1, kernel=kernel)
    return "ai.stofc:FusedGemm"


def _norm_node(em: _Emitter, x_dt: str, residual: str | None, seg: Segment, norm: str,
               shift: bool, out: str, pre: str | None, kernel: str) -> str:
    inputs = [x_dt, em.half(residual) if residual else "", em.weight(_need(seg, "gamma"))]
    beta = seg.binding("beta")
    if shift and beta:
        inputs.append(em.weight(beta))
    outputs = [out] + ([pre] if pre else [])
    em.node("AddLayerNorm", inputs, outputs, domain=DOMAIN, stem="AddLayerNorm",
            epsilon=float(seg.epsilon), rms=int(norm == "rmsnorm"), kernel=kernel)
    return "ai.stofc:AddLayerNorm"


def _layouts(graph: ModelGraph, layer: int) -> dict[str, str]:
    chain = graph.layers[layer].chain
    return {str(op.param("weight")): str(op.param("weight_layout", "KN"))
            for op in chain if op.param("weight")}


def _need(seg: Segment, slot: str) -> str:
    """A binding the family requires; its absence is a plan bug, said in one line."""
    value = seg.binding(slot)
    if value is None:
        raise PlanError(f"segment {seg.ordinal} of layer {seg.layer} ({seg.family}) has no "
                        f"'{slot}' binding", hint="this is a stofc bug; report it")
    return value


def emit_segment(em: _Emitter, graph: ModelGraph, seg: Segment, kernel: str,
                 attention: AttentionBinding | None) -> EmittedSegment:
    """Append the nodes of one segment to ``em`` (see the module contract)."""
    first = len(em.nodes)
    ops: list[str] = []
    note = ""
    if seg.family == "attention":
        if attention is None:
            raise PlanError(f"layer {seg.layer} has no attention binding",
                            hint="this is a stofc bug; report it")
        block = graph.layers[seg.layer].attention
        if block.packed_qkv:
            packed = em.half(block.q_input)
            q, k, v = (em.name(n) for n in ("q", "k", "v"))
            if em.opset >= 13:
                split = em.name("split")
                em.inits[split] = numpy_helper.from_array(
                    np.array([block.hidden_size] * 3, np.int64), split)
                em.node("Split", [packed, split], [q, k, v], axis=-1)
            else:
                em.node("Split", [packed], [q, k, v], axis=-1, split=[block.hidden_size] * 3)
            ops.append("onnx:Split")
            note = "packed QKV split into Q, K, V (layout [3, H, D] on the last axis)"
        else:
            q, k, v = (em.half(x) for x in (block.q_input, block.k_input, block.v_input))
        inputs = [q, k, v, attention.key_padding_mask or "",
                  em.half(attention.bias) if attention.bias else ""]
        while inputs[-1] == "":
            inputs.pop()
        em.node("SparseAttention", inputs, [em.output(seg.outputs[-1])], domain=DOMAIN,
                stem="SparseAttention", num_heads=block.num_heads, head_dim=block.head_dim,
                scale=float(block.scale), mask_file=attention.mask_file, kernel=attention.kernel,
                **dict(attention.launch))
        ops.append("ai.stofc:SparseAttention")
        return EmittedSegment(seg.layer, seg.ordinal, seg.family, tuple(ops),
                              tuple(n.name for n in em.nodes[first:]), note)

    layouts = _layouts(graph, seg.layer)
    ep = seg.epilogues[-1]
    out = em.output(_need(seg, "out"))
    pre_name = seg.binding("pre_norm_out")
    pre = em.output(pre_name) if pre_name else None
    x = em.half(_need(seg, "x"))
    residual = seg.binding("residual")
    if seg.family == "gemm_gemm":
        e1 = seg.epilogues[0]
        hidden = em.name("ffn_hidden")
        w0 = _need(seg, "w0")
        if e1.act in _OPS_FOR_ACT:
            ops.append(_gemm_node(em, x, w0, seg.binding("b0"), None, e1.act, hidden, kernel,
                                  layouts.get(w0, "KN")))
        else:
            raw = em.name("ffn_raw")
            ops.append(_gemm_node(em, x, w0, None, None, "none", raw, kernel,
                                  layouts.get(w0, "KN")))
            ops += _emit_fp32_tail(em, raw, hidden, bias=seg.binding("b0"), act=e1.act,
                                   residual=None)
        x, w, b = hidden, _need(seg, "w1"), seg.binding("b1")
    elif seg.family != "add_norm":
        w, b = _need(seg, "w0"), seg.binding("b0")
    if seg.family in ("gemm", "gemm_gemm") and ep.norm == "none":
        if ep.act in _OPS_FOR_ACT:
            ops.append(_gemm_node(em, x, w, b, residual if ep.residual else None, ep.act, out,
                                  kernel, layouts.get(w, "KN")))
        else:
            raw = em.name("gemm_raw")
            ops.append(_gemm_node(em, x, w, None, None, "none", raw, kernel, layouts.get(w, "KN")))
            ops += _emit_fp32_tail(em, raw, out, bias=b, act=ep.act,
                                   residual=residual if ep.residual else None)
            note = f"activation {ep.act} has no FusedGemm form: float32 ONNX ops after the GEMM"
    elif seg.family in ("gemm", "gemm_norm", "gemm_gemm"):
        y = em.name("gemm_out")
        ops.append(_gemm_node(em, x, w, b, None, ep.act if ep.act in _OPS_FOR_ACT else "none",
                              y, kernel, layouts.get(w, "KN")))
        if ep.act not in _OPS_FOR_ACT:
            y2 = em.name("act_out")
            ops += _emit_fp32_tail(em, y, y2, bias=None, act=ep.act, residual=None)
            y = y2
        ops.append(_norm_node(em, y, residual if ep.residual else None, seg, ep.norm,
                              ep.norm_shift, out, pre, kernel))
    elif seg.family == "add_norm":
        if ep.bias or ep.act != "none":
            y = em.name("tail_out") if ep.norm != "none" else out
            ops += _emit_fp32_tail(em, x, y, bias=seg.binding("bias") if ep.bias else None,
                                   act=ep.act, residual=None if ep.norm != "none" or not
                                   ep.residual else residual)
            note = "bias/activation without a GEMM: float32 ONNX ops"
            x = y
        if ep.norm != "none":
            ops.append(_norm_node(em, x, residual if ep.residual else None, seg, ep.norm,
                                  ep.norm_shift, out, pre, kernel))
        elif ep.residual and not (ep.bias or ep.act != "none"):
            ops += _emit_fp32_tail(em, x, out, bias=None, act="none", residual=residual)
            note = "residual add without a norm: a float32 ONNX Add"
    else:
        raise PlanError(f"segment family {seg.family!r} cannot be written",
                        hint="this is a stofc bug; report it")
    return EmittedSegment(seg.layer, seg.ordinal, seg.family, tuple(ops),
                          tuple(n.name for n in em.nodes[first:]), note)


def rewrite_model(graph: ModelGraph, plan: Plan, kernels: dict[tuple[int, int], str],
                  attention: dict[int, AttentionBinding]) -> tuple[onnx.ModelProto,
                                                                     tuple[EmittedSegment, ...]]:
    """The package's model.onnx and how each segment was emitted (see the module doc).

    ``kernels[(layer, ordinal)]`` is the ``kernel`` attribute of the segment's
    nodes; ``attention[layer]`` the SparseAttention node's other inputs.
    """
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    idx = GraphIndex(model)
    em = _Emitter(idx, plan.dtype, graph.opset)
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
                                        attention.get(seg.layer)))
    removed = _restore_needed(list(model.graph.node), removed, set(em.fused),
                              set(idx.graph_outputs))
    kept = [n for n in model.graph.node if n.name not in removed]
    needed = {i for n in kept for i in n.input if i} | set(idx.graph_outputs)
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


def float_type(idx: GraphIndex) -> int:
    """The model's float type where shape inference left a value untyped: its weights' type."""
    counts: dict[int, int] = {}
    for t in idx.initializers.values():
        if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16):
            counts[t.data_type] = counts.get(t.data_type, 0) + 1
    return max(counts, key=lambda k: counts[k]) if counts else TensorProto.FLOAT


def _restore_needed(nodes: list[onnx.NodeProto], removed: set[str], fused: set[str],
                    outputs: set[str]) -> set[str]:
    """Keep removed nodes whose results unfused nodes still read (shared shape/bias helpers)."""
    removed = set(removed)
    changed = True
    while changed:
        changed = False
        reads = {i for n in nodes if n.name not in removed for i in n.input if i} | outputs
        reads |= _subgraph_inputs([n for n in nodes if n.name not in removed])
        for node in nodes:
            if node.name in removed and any(o in reads and o not in fused for o in node.output):
                removed.discard(node.name)
                changed = True
    return removed


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
