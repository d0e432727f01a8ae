"""The emitters: one function per segment kind writing it as ai.stofc nodes (``cuda/ort/OPS.md``).

Each is registered for its kinds with :func:`emits` (a second emitter for a kind is a
:class:`~stofc.errors.RegistryError` at import); :func:`emit_segment` writes a segment
through the one registered for its kind and returns what it emitted. A new segment kind
(a gated MLP: ``gemm_glu``, GatedGemm) adds one ``@emits("kind")`` function here; the rewrite
(:mod:`stofc.lower.rewrite`) does not change.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from onnx import numpy_helper

from stofc.errors import PlanError, RegistryError
from stofc.frontend.types import ModelGraph
from stofc.lower.attention_io import (
    attention_attributes,
    flat_input,
    reshaped_ops,
    rotary_input,
)
from stofc.lower.emit import (
    DOMAIN,
    KERNEL_ABI,
    AttentionBinding,
    EmittedSegment,
    Emitter,
    norm_param,
)
from stofc.plan.plan import Segment

_OPS_FOR_ACT = ("none", "gelu_erf", "gelu_tanh")   # FusedGemm's activations


def _emit_fp32_tail(em: Emitter, x_dt: str, out_name: str, *, bias: str | None, act: str,
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


def _gelu_f32(em: Emitter, x: str, out: str, *, tanh: bool) -> None:
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


def _gemm_node(em: Emitter, x_dt: str, w: str, b: str | None, residual: str | None,
               act: str, out: str, kernel: str, layout: str) -> str:
    inputs = [x_dt, em.weight(w, transpose=layout == "NK"), em.weight(b) if b else ""]
    if residual:
        inputs.append(em.half(residual))
    while inputs and inputs[-1] == "":
        inputs.pop()
    em.node("FusedGemm", inputs, [out], domain=DOMAIN, stem="FusedGemm", activation=act,
            residual_after_activation=1, kernel=kernel)
    return "ai.stofc:FusedGemm"


def _norm_node(em: Emitter, x_dt: str, residual: str | None, seg: Segment, norm: str,
               shift: bool, out: str, pre: str | None, kernel: str) -> str:
    """AddLayerNorm; in a bfloat16 package gamma and beta stay float32 (:func:`norm_param`)."""
    inputs = [x_dt, em.half(residual) if residual else "", norm_param(em, _need(seg, "gamma"))]
    beta = seg.binding("beta")
    if shift and beta:
        inputs.append(norm_param(em, beta))
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


Written = tuple[list[str], str, tuple[str, ...] | None]   # ops, note, the model's own nodes
Emitter_ = Callable[["Emitter", ModelGraph, Segment, str, "AttentionBinding | None", bool],
                    Written]
_EMITTERS: dict[str, Emitter_] = {}


def emits(*kinds: str) -> Callable[[Emitter_], Emitter_]:
    """Decorator: the function writing segments of ``kinds`` as ai.stofc nodes (loud on a
    second one for a kind). It returns the ops it emitted, a note, and the model's own
    nodes that run the segment when it emits none (else None: the nodes it emitted)."""
    def wrap(fn: Emitter_) -> Emitter_:
        for kind in kinds:
            if kind in _EMITTERS:
                raise RegistryError(f"segment kind {kind!r} has two emitters "
                                    f"({_EMITTERS[kind].__name__} and {fn.__name__})")
            _EMITTERS[kind] = fn
        return fn
    return wrap


def emit_segment(em: Emitter, graph: ModelGraph, seg: Segment, kernel: str,
                 attention: AttentionBinding | None, *, packed_q: bool = False
                 ) -> EmittedSegment:
    """Append the nodes of one segment to ``em`` (see the module contract): the emitter
    registered for its kind writes them.

    ``packed_q``: a block whose Q, K, V are one packed ``[B, S, 3*H*D]`` value
    (``AttentionBlock.packed_qkv``, laid out Q | K | V) feeds it to
    SparseAttention's ``q`` with ``k`` and ``v`` omitted (OPS.md, packed QKV)
    instead of splitting it first.
    """
    emitter = _EMITTERS.get(seg.family)
    if emitter is None:
        raise PlanError(f"segment family {seg.family!r} cannot be written",
                        hint="this is a stofc bug; report it")
    first = len(em.nodes)
    ops, note, own = emitter(em, graph, seg, kernel, attention, packed_q)
    nodes = own if own is not None else tuple(n.name for n in em.nodes[first:])
    return EmittedSegment(seg.layer, seg.ordinal, seg.family, tuple(ops), nodes, note)


@emits("ort")
def _emit_ort(em: Emitter, graph: ModelGraph, seg: Segment, kernel: str,
              attention: AttentionBinding | None, packed_q: bool) -> Written:
    """Nothing new: the model's own nodes stay, ONNX Runtime runs them."""
    chain = graph.layers[seg.layer].chain
    nodes = tuple(n for i in seg.ops for n in chain[i].nodes)
    types = {em.idx.by_name[n].op_type for n in nodes if n in em.idx.by_name}
    em.kept.update(nodes)
    return ([f"onnx:{t}" for t in sorted(types)],
            "no template implements it: the model's own nodes, run by ONNX Runtime", nodes)


@emits("attention")
def _emit_attention(em: Emitter, graph: ModelGraph, seg: Segment, kernel: str,
                    attention: AttentionBinding | None, packed_q: bool) -> Written:
    """SparseAttention (+ Rotary for a RoPE stofc runs, + a Split of a packed projection,
    + one KeyPrep per mask value)."""
    ops: list[str] = []
    note = ""
    if attention is None:
        raise PlanError(f"layer {seg.layer} has no attention binding",
                        hint="this is a stofc bug; report it")
    block = graph.layers[seg.layer].attention
    if block.rope_fusion is not None:
        rotated, ops, note = rotary_input(em, block)
        q, k, v = rotated, "", ""
    elif block.packed_qkv and packed_q:
        q, k, v = em.half(block.q_input), "", ""
        note = "packed QKV read as SparseAttention's q (k, v omitted; [Q | K | V] of H*D each)"
    elif block.packed_qkv:
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
        q, k, v = (flat_input(em, x, lay) for x, lay in (
            (block.q_input, block.q_layout), (block.k_input, block.k_layout),
            (block.v_input, block.v_layout)))
        ops.extend(reshaped_ops(block))
    key_state = ""
    if attention.key_padding_mask:
        key_state, prep = em.key_state(attention.key_padding_mask)
        if prep is not None:
            ops.append("ai.stofc:KeyPrep")
            note = "; ".join(filter(None, [note, (
                f"{prep.name}: KeyPrep of key_padding_mask {attention.key_padding_mask!r}, "
                "its key_state read by every SparseAttention on that mask (OPS.md)")]))
    inputs = [q, k, v, attention.key_padding_mask or "",
              em.half(attention.bias) if attention.bias else "", key_state]
    while inputs[-1] == "" and len(inputs) > 3:
        inputs.pop()
    em.node("SparseAttention", inputs, [em.output(seg.outputs[-1])], domain=DOMAIN,
            stem="SparseAttention", num_heads=block.num_heads, head_dim=block.head_dim,
            scale=float(block.scale), mask_file=attention.mask_file, kernel=attention.kernel,
            **attention_attributes(block), **dict(attention.launch),
            **({"kernel_abi": KERNEL_ABI} if KERNEL_ABI is not None else {}))
    ops.append("ai.stofc:SparseAttention")
    return ops, note, None


@emits("gemm", "gemm_norm", "gemm_gemm")
def _emit_gemm(em: Emitter, graph: ModelGraph, seg: Segment, kernel: str,
               attention: AttentionBinding | None, packed_q: bool) -> Written:
    """FusedGemm (a GEMM+GEMM segment's first GEMM as one more), + AddLayerNorm with a
    norm; activations without a FusedGemm form as float32 ONNX ops."""
    ops: list[str] = []
    note = ""
    layouts = _layouts(graph, seg.layer)
    ep = seg.epilogues[-1]
    out = em.output(_need(seg, "out"))
    pre_name = seg.binding("pre_norm_out")
    pre = em.output(pre_name) if pre_name else None
    x = em.half(_need(seg, "x"))
    residual = seg.binding("residual")
    w, b = _need(seg, "w0"), seg.binding("b0")
    if seg.binding("w1") is not None:           # GEMM+GEMM: the first GEMM and its epilogue
        e1 = seg.epilogues[0]
        hidden = em.name("ffn_hidden")
        if e1.act in _OPS_FOR_ACT:
            ops.append(_gemm_node(em, x, w, b, None, e1.act, hidden, kernel,
                                  layouts.get(w, "KN")))
        else:
            raw = em.name("ffn_raw")
            ops.append(_gemm_node(em, x, w, None, None, "none", raw, kernel,
                                  layouts.get(w, "KN")))
            ops += _emit_fp32_tail(em, raw, hidden, bias=b, act=e1.act, residual=None)
        x, w, b = hidden, _need(seg, "w1"), seg.binding("b1")
    if ep.norm == "none":
        if ep.act in _OPS_FOR_ACT:
            ops.append(_gemm_node(em, x, w, b, residual if ep.residual else None, ep.act, out,
                                  kernel, layouts.get(w, "KN")))
        else:
            raw = em.name("gemm_raw")
            ops.append(_gemm_node(em, x, w, None, None, "none", raw, kernel, layouts.get(w, "KN")))
            ops += _emit_fp32_tail(em, raw, out, bias=b, act=ep.act,
                                   residual=residual if ep.residual else None)
            note = f"activation {ep.act} has no FusedGemm form: float32 ONNX ops after the GEMM"
    else:
        # The residual joins the norm, not the GEMM. Tried (BERT-base at 8192 tokens, H100,
        # e2e-long-h100-2026-11-27-pdl-ab-off): as cuBLASLt's C the norm fell from 12.5 to 7.9 us
        # but the N = 768 GEMMs rose from 35.7 to 39.8 us (their epilogue reads C after the
        # mainloop), a wash in time, and the sum rounded to float16 at the residual stream's
        # magnitude raised verify's error from 1.7-1.9e-3 to 2.2-2.3e-3.
        y = em.name("gemm_out")
        ops.append(_gemm_node(em, x, w, b, None, ep.act if ep.act in _OPS_FOR_ACT else "none",
                              y, kernel, layouts.get(w, "KN")))
        if ep.act not in _OPS_FOR_ACT:
            y2 = em.name("act_out")
            ops += _emit_fp32_tail(em, y, y2, bias=None, act=ep.act, residual=None)
            y = y2
        ops.append(_norm_node(em, y, residual if ep.residual else None, seg, ep.norm,
                              ep.norm_shift, out, pre, kernel))
    return ops, note, None


@emits("add_norm")
def _emit_add_norm(em: Emitter, graph: ModelGraph, seg: Segment, kernel: str,
                   attention: AttentionBinding | None, packed_q: bool) -> Written:
    """AddLayerNorm; a bias or activation before it, or a residual add without a norm, as
    float32 ONNX ops."""
    ops: list[str] = []
    note = ""
    ep = seg.epilogues[-1]
    out = em.output(_need(seg, "out"))
    pre_name = seg.binding("pre_norm_out")
    pre = em.output(pre_name) if pre_name else None
    x = em.half(_need(seg, "x"))
    residual = seg.binding("residual")
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
    return ops, note, None


@emits("gemm_glu")
def _emit_gated_gemm(em: Emitter, graph: ModelGraph, seg: Segment, kernel: str,
                     attention: AttentionBinding | None, packed_q: bool) -> Written:
    """GatedGemm: ``act(x @ [Wg | Wu] + [bg | bu])`` halves multiplied (OPS.md)."""
    w, b = _need(seg, "w0"), seg.binding("b0")
    inputs = [em.half(_need(seg, "x")),
              em.weight(w, transpose=_layouts(graph, seg.layer).get(w, "KN") == "NK")]
    if b:
        inputs.append(em.weight(b))
    em.node("GatedGemm", inputs, [em.output(_need(seg, "out"))], domain=DOMAIN,
            stem="GatedGemm", activation=seg.epilogues[0].act, kernel=kernel)
    return ["ai.stofc:GatedGemm"], "", None


@emits("glu")
def _emit_gated_alone(em: Emitter, graph: ModelGraph, seg: Segment, kernel: str,
                      attention: AttentionBinding | None, packed_q: bool) -> Written:
    """A gated activation without its GEMM (bias?, gated): float32 ONNX ops between Casts."""
    ep, f = seg.epilogues[0], seg.dim("n") // 2
    v = em.fp32(em.half(_need(seg, "x")))
    ops = []
    if ep.bias:
        v2 = em.name("bias_f32")
        em.node("Add", [v, em.weight_f32(_need(seg, "bias"))], [v2])
        v, ops = v2, ["Add"]
    gate, up, act, prod = (em.name(n) for n in ("gate_f32", "up_f32", "act_f32", "glu_f32"))
    if em.opset >= 13:
        sizes = em.name("split")
        em.inits[sizes] = numpy_helper.from_array(np.array([f, f], np.int64), sizes)
        em.node("Split", [v, sizes], [gate, up], axis=-1)
    else:
        em.node("Split", [v], [gate, up], axis=-1, split=[f, f])
    if ep.act == "relu":
        em.node("Relu", [gate], [act])
    elif ep.act == "silu":
        sig = em.name("sigmoid_f32")
        em.node("Sigmoid", [gate], [sig])
        em.node("Mul", [gate, sig], [act])
    else:
        _gelu_f32(em, gate, act, tanh=ep.act == "gelu_tanh")
    em.node("Mul", [act, up], [prod])
    em.node("Cast", [prod], [em.output(_need(seg, "out"))], stem="cast_out", to=em.elem)
    ops += ["Split", "Relu" if ep.act == "relu" else "Sigmoid" if ep.act == "silu"
            else "Gelu(decomposed)", "Mul"]
    return ([f"onnx:{o}" for o in ops],
            "gated activation without its GEMM: float32 ONNX ops", None)
