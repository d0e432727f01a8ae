"""Emit one plan segment as ai.stofc nodes (``cuda/ort/OPS.md``): the rewrite's node factory.

:class:`Emitter` holds the nodes being built, the converted weights and the
name maps (an unfused value's dtype twin made by a ``Cast``; a fused result's
twin). :func:`emit_segment` writes a segment through the emitter registered for its
kind with :func:`emits` (see :mod:`stofc.lower.rewrite` for the table) and returns
what it emitted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from stofc.errors import PlanError
from stofc.frontend.graph import GraphIndex
from stofc.frontend.types import ModelGraph
from stofc.lower.attention_io import attention_attributes, flat_input, reshaped_ops
from stofc.plan.plan import Segment

DOMAIN = "ai.stofc"
DOMAIN_VERSION = 1
ELEM = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
_TAG = {"float16": "f16", "bfloat16": "bf16"}
_OPS_FOR_ACT = ("none", "gelu_erf", "gelu_tanh")
# ``kernel_abi``: the frozen argument lists the CUDA twins launch (cuda/ort/attention_abi.h
# kAttentionKernelAbi == cuda_attrs.h kCudaLaunchAbi).
KERNEL_ABI: int | None = 3


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


class Emitter:
    """Builds the new nodes: value name maps, Casts, converted weights."""

    def __init__(self, idx: GraphIndex, dtype: str, opset: int) -> None:
        self.idx, self.dtype, self.opset = idx, dtype, opset
        self.elem, self.tag = ELEM[dtype], _TAG[dtype]
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, TensorProto] = {}
        self.fused: dict[str, str] = {}    # original value -> its dtype twin, made by a fused op
        self.casts: dict[str, str] = {}    # unfused value -> its dtype twin (Cast)
        self.key_states: dict[str, str] = {}   # key_padding_mask -> its KeyPrep's key_state
        self.kept: set[str] = set()          # the model's own nodes that run a segment
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

    def key_state(self, mask: str) -> tuple[str, onnx.NodeProto | None]:
        """``mask``'s key_state and the KeyPrep node emitted for it now (None when an
        earlier SparseAttention on the same mask emitted it: one KeyPrep per mask value)."""
        if mask in self.key_states:
            return self.key_states[mask], None
        state = f"{mask}::stofc_key_state"
        node = self.node("KeyPrep", [mask], [state], domain=DOMAIN, stem="KeyPrep")
        self.key_states[mask] = state
        return state, node

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


def tensor_bits(tensor: TensorProto) -> np.ndarray:
    """A float16 / bfloat16 initializer's elements as their uint16 bit patterns, in its shape."""
    if tensor.data_type not in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
        raise PlanError(f"initializer {tensor.name!r} is not float16 or bfloat16",
                        hint="this is a stofc bug; report it")
    if tensor.raw_data:
        bits = np.frombuffer(tensor.raw_data, dtype="<u2")
    else:  # ONNX keeps 16-bit floats' bit patterns in int32_data without raw_data
        bits = np.asarray(tensor.int32_data, dtype=np.int64).astype(np.uint16)
    return bits.reshape(tuple(tensor.dims)).astype(np.uint16)


def bits_tensor(bits: np.ndarray, data_type: int, name: str) -> TensorProto:
    """The inverse of :func:`tensor_bits`: uint16 bit patterns as a 16-bit float initializer."""
    tensor = TensorProto(name=name, data_type=data_type, dims=list(bits.shape))
    tensor.raw_data = np.ascontiguousarray(bits, dtype="<u2").tobytes()
    return tensor


def to_tensor(array: np.ndarray, dtype: str, name: str) -> TensorProto:
    """A float array as a float16 or bfloat16 (round to nearest even) initializer."""
    if dtype == "float16":
        return numpy_helper.from_array(array.astype(np.float16), name)
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    tensor = TensorProto(name=name, data_type=TensorProto.BFLOAT16, dims=list(array.shape))
    tensor.raw_data = bits.tobytes()
    return tensor


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


def norm_param(em: Emitter, name: str) -> str:
    """A LayerNorm gamma / beta initializer as AddLayerNorm reads it.

    float16 packages: in the dtype. bfloat16 packages: float32 (OPS.md, AddLayerNorm
    types). bf16's 8-bit mantissa puts each channel's scale off by up to 2^-8 of itself,
    the same error on every token, compounded over the layers' norms; it alone cost
    6.3e-3 of the example's 1e-2 bound (bench/results/bf16-error-budget-cpu-2026-11-22.md).
    Mixed-precision practice keeps them float32 too (autocast runs layer_norm in fp32).
    """
    return em.weight_f32(name) if em.dtype == "bfloat16" else em.weight(name)


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


class RegistryError(ValueError):
    """Two emitters for one segment kind."""


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
    """SparseAttention (+ a Split of a packed projection, + one KeyPrep per mask value)."""
    ops: list[str] = []
    note = ""
    if attention is None:
        raise PlanError(f"layer {seg.layer} has no attention binding",
                        hint="this is a stofc bug; report it")
    block = graph.layers[seg.layer].attention
    if block.packed_qkv and packed_q:
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
