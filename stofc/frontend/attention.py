"""Find multi-head attention blocks by walking dataflow outwards from each Softmax.

From a Softmax the matcher walks *back* over the score ops (mask Add/Where,
scale Div/Mul, Cast) to the ``Q Kᵀ`` MatMul, then back from each MatMul
operand over layout ops (Transpose, Reshape, Split/Slice/Gather of a packed
QKV, Mul by the split scale) to the projected Q/K/V values; and *forward* over
the IsNaN/Where guard to ``P V`` and the head merge. ONNX's ``Attention`` op
(opset 23) is read from its attributes. Names are never looked at.

A candidate that does not fit (no ``Q Kᵀ``, non-constant scale, grouped KV
heads, softcap ...) becomes an :class:`Unsupported` with the reason and is
left to ONNX Runtime. A head count that is not a constant raises ModelError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx

from stofc.errors import ModelError
from stofc.frontend.graph import GraphIndex
from stofc.frontend.load import opset_of
from stofc.frontend.masks import classify_mask
from stofc.frontend.types import AttentionBlock, Unsupported

_PASS = ("Transpose", "Cast", "Identity", "Squeeze", "Unsqueeze", "Split", "Slice", "Reshape")


class _Skip(Exception):
    """This candidate is not an attention we handle: carries the reason."""


@dataclass
class _Operand:
    """The result of walking back from a MatMul operand to its projection."""

    source: str                       # projected value (after bias) feeding the head split
    nodes: list[onnx.NodeProto]
    head_split: onnx.NodeProto | None  # the Reshape [.., hidden] -> [.., H, D]
    factors: list[float]              # constant scale factors met on the way
    rotary: bool = False              # stopped at a rotary position embedding (RoPE)


def _target(idx: GraphIndex, reshape: onnx.NodeProto) -> list[int | None] | None:
    """The Reshape's output dims (ints where known), from its shape input or inference."""
    target = idx.partial(reshape.input[1])
    inferred = idx.shape(reshape.output[0])
    if target is None:
        return None if inferred is None else [d if isinstance(d, int) else None
                                              for d in inferred]
    if inferred is not None and len(inferred) == len(target):
        target = [t if t is not None and t > 0 else (i if isinstance(i, int) else t)
                  for t, i in zip(target, inferred, strict=False)]
    return target


def _is_head_split(idx: GraphIndex, reshape: onnx.NodeProto) -> bool:
    """[.., hidden] -> [.., H, D] (or [.., 3, H, D]): the input's last dim is split."""
    in_shape, target = idx.shape(reshape.input[0]), _target(idx, reshape)
    if in_shape is None or target is None or len(target) <= len(in_shape):
        return False
    tail, hidden = target[len(in_shape) - 1:], in_shape[-1]
    if not isinstance(hidden, int):
        return False  # e.g. [B*H, D, S] -> [B, H, D, S]: a K transpose detour, not a split
    if all(isinstance(t, int) and t > 0 for t in tail):
        return math.prod(tail) == hidden
    # a head count computed at run time: still the split if D divides the hidden size
    return len(target) >= 4 and isinstance(tail[-1], int) and tail[-1] > 0 \
        and hidden % tail[-1] == 0


def _walk_operand(idx: GraphIndex, value: str) -> _Operand:
    nodes, factors, head_split = [], [], None
    while True:
        node = idx.produced_by(value)
        if node is None:
            break
        op = node.op_type
        nxt = node.input[0] if node.input else ""
        if head_split is not None and op not in ("Split", "Slice", "Gather", "Cast", "Identity",
                                                 "Mul", "Div"):
            break  # past the head split only a packed-QKV split (or the scale) belongs here
        if op in ("Mul", "Div"):
            a, b = node.input[0], node.input[1]
            sa, sb = idx.scalar(a), idx.scalar(b)
            if sb is not None:
                factors.append(sb if op == "Mul" else 1.0 / sb)
                nxt = a
            elif sa is not None and op == "Mul":
                factors.append(sa)
                nxt = b
            else:
                break
        elif op == "Gather":
            index = idx.const(node.input[1])
            if index is None or index.size != 1:
                break
        elif op == "Reshape" and _is_head_split(idx, node):
            head_split = node
        elif op not in _PASS:
            break
        nodes.append(node)
        value = nxt
    return _Operand(value, nodes, head_split, factors, _is_rotary(idx, value))


def _is_rotary(idx: GraphIndex, value: str) -> bool:
    """x*cos + rotate_half(x)*sin: an Add over Muls with a Neg and a Concat/Slice nearby."""
    node = idx.produced_by(value, "Add")
    if node is None:
        return False
    ops = {n.op_type for n in idx.ancestors(value, limit=14)}
    return {"Mul", "Neg"} <= ops and bool(ops & {"Concat", "Slice", "Split"})


def _find_head_split(idx: GraphIndex, value: str) -> onnx.NodeProto | None:
    """The nearest head-split Reshape among the ancestors (through RoPE and the like)."""
    for node in idx.ancestors(value, limit=60):
        if node.op_type == "Reshape" and _is_head_split(idx, node):
            return node
    return None


def _heads_from_reshapes(idx: GraphIndex, operand: _Operand, where: str) -> tuple[int, int] | None:
    """(num_heads, head_dim) from the head-split Reshape's target shape, if one exists."""
    node = operand.head_split
    if node is None:
        return None
    target = _target(idx, node) or [None, None]
    heads, dim = target[-2], target[-1]
    if heads == -1 and dim:
        in_shape = idx.shape(node.input[0]) or ()
        if in_shape and isinstance(in_shape[-1], int):
            heads = in_shape[-1] // dim
    if heads is None or heads <= 0 or dim is None or dim <= 0:
        raise ModelError(
            f"attention at node {where}: the head count is not a constant (reshape "
            f"{node.name} splits heads with a shape computed at run time)",
            hint="export the model with a fixed number of heads")
    return int(heads), int(dim)


def _heads_from_shape(idx: GraphIndex, value: str) -> tuple[int, int] | None:
    shape = idx.shape(value)
    if shape is not None and len(shape) == 4 and isinstance(shape[1], int) \
            and isinstance(shape[3], int):
        return shape[1], shape[3]
    return None


def _walk_scores(idx: GraphIndex, value: str):
    """Back from the Softmax input to Q Kᵀ: (matmul, nodes, factors, mask values, where_masks)."""
    nodes, factors, additive, boolean = [], [], [], []
    for _ in range(16):
        node = idx.produced_by(value)
        if node is None:
            raise _Skip("the Softmax input is not computed from Q·Kᵀ")
        op = node.op_type
        if op == "MatMul":
            if idx.const(node.input[0]) is not None or idx.const(node.input[1]) is not None:
                raise _Skip("the scores come from a MatMul with a constant operand")
            return node, nodes, factors, additive, boolean
        nodes.append(node)
        if op in ("Cast", "Identity"):
            value = node.input[0]
        elif op in ("Mul", "Div"):
            sa, sb = idx.scalar(node.input[0]), idx.scalar(node.input[1])
            if sb is not None:
                factors.append((sb, "mul") if op == "Mul" else (1.0 / sb, "div"))
                value = node.input[0]
            elif sa is not None and op == "Mul":
                factors.append((sa, "mul"))
                value = node.input[1]
            else:
                raise _Skip(f"the scores are scaled by a non-constant value ({node.name})")
        elif op == "Add":
            a, b = node.input
            if _reaches_scores(idx, a):
                value, other = a, b
            elif _reaches_scores(idx, b):
                value, other = b, a
            else:
                raise _Skip(f"cannot tell the scores from the mask at {node.name}")
            additive.append(other)
        elif op == "Where":
            cond, x, y = node.input
            if _reaches_scores(idx, x) and idx.const(y) is not None:
                value = x
            elif _reaches_scores(idx, y) and idx.const(x) is not None:
                value = y
            else:
                raise _Skip(f"unsupported Where on the scores ({node.name})")
            boolean.append(cond)
        elif op == "Tanh":
            raise _Skip("logit soft-capping (Tanh on the scores) is not supported")
        else:
            raise _Skip(f"unsupported operator {op} between Q·Kᵀ and Softmax ({node.name})")
    raise _Skip("too many operators between Q·Kᵀ and Softmax")


def _reaches_scores(idx: GraphIndex, value: str, depth: int = 0) -> bool:
    node = idx.produced_by(value)
    if node is None or depth > 8:
        return False
    if node.op_type == "MatMul":
        return idx.const(node.input[0]) is None and idx.const(node.input[1]) is None and \
            not idx.is_initializer_like(node.input[1])
    if node.op_type in ("Cast", "Identity", "Mul", "Div", "Add", "Sub", "Where", "Tanh",
                        "Reshape", "Transpose", "Expand"):
        return any(_reaches_scores(idx, i, depth + 1) for i in node.input
                   if i and idx.const(i) is None)
    return False


def _walk_probs(idx: GraphIndex, softmax: onnx.NodeProto):
    """Forward from Softmax over guards/casts to P·V: (pv matmul, nodes, guarded)."""
    value, nodes, guarded = softmax.output[0], [], False
    for _ in range(8):
        users = idx.data_users(value)
        isnan = [u for u in users if u.op_type in ("IsNaN", "IsInf")]
        where = [u for u in users if u.op_type == "Where" and value in u.input[1:]]
        if isnan and where:
            nodes.extend(isnan + where[:1])
            guarded = True
            value = where[0].output[0]
            continue
        if len(users) != 1:
            raise _Skip("the attention probabilities feed more than one operator")
        user = users[0]
        if user.op_type == "MatMul" and user.input[0] == value:
            return user, nodes, guarded
        if user.op_type in ("Cast", "Identity", "Dropout"):
            nodes.append(user)
            value = user.output[0]
            continue
        raise _Skip(f"the attention probabilities feed {user.op_type}, not P·V")
    raise _Skip("P·V not found after Softmax")


def _walk_merge(idx: GraphIndex, value: str):
    """Forward from P·V over the head merge, up to the Reshape back to [.., hidden]."""
    nodes = []
    while True:
        user = idx.sole_data_user(value)
        if user is None or user.op_type not in ("Transpose", "Reshape", "Cast", "Identity"):
            return value, nodes
        nodes.append(user)
        value = user.output[0]
        rank = idx.rank(value)
        if user.op_type == "Reshape" and rank is not None and rank <= 3:
            return value, nodes


def match_softmax(idx: GraphIndex, softmax: onnx.NodeProto) -> AttentionBlock:
    """The attention block around ``softmax`` (layer=-1), or raise _Skip with the reason."""
    rank = idx.rank(softmax.input[0])
    axis = idx.attr(softmax, "axis", -1 if opset_of(idx.model) >= 13 else 1)
    if rank is not None and axis not in (-1, rank - 1):
        raise _Skip(f"Softmax over axis {axis}, not the key axis")
    qk, score_nodes, factors, additive, boolean = _walk_scores(idx, softmax.input[0])
    pv, prob_nodes, guarded = _walk_probs(idx, softmax)
    q, k, v = (_walk_operand(idx, x) for x in (qk.input[0], qk.input[1], pv.input[1]))
    if q.head_split is None and q.rotary:
        q.head_split = _find_head_split(idx, q.source)
    heads = (_heads_from_reshapes(idx, q, softmax.name) or _heads_from_shape(idx, qk.input[0])
             or _heads_from_reshapes(idx, k, softmax.name))
    if heads is None:
        raise _Skip("cannot determine the head count (no head-split Reshape of Q and no static "
                    "Q shape)")
    num_heads, head_dim = heads
    for name, op in (("K", k), ("V", v)):
        other = _heads_from_reshapes(idx, op, softmax.name)
        if other is not None and other[0] != num_heads:
            raise _Skip(f"{name} has {other[0]} heads and Q {num_heads} "
                        "(grouped-query attention is not supported)")
    out, merge_nodes = _walk_merge(idx, pv.output[0])
    scale, form = _scale(factors, q.factors, k.factors)
    mask = classify_mask(idx, additive, boolean)
    nodes = [*q.nodes, *k.nodes, *v.nodes, qk, *score_nodes, softmax, *prob_nodes, pv,
             *merge_nodes]
    return AttentionBlock(
        layer=-1, num_heads=num_heads, head_dim=head_dim, hidden_size=num_heads * head_dim,
        nodes=idx.in_order(n.name for n in nodes), q_input=q.source, k_input=k.source,
        v_input=v.source, output=out, packed_qkv=q.source == k.source == v.source,
        scale=scale, scale_form=form, mask_form=mask.form, mask_source=mask.source,
        bias_input=mask.bias_input, softmax_guarded=guarded, causal_in_graph=mask.causal,
        mask_input=mask.value, rotary=q.rotary or k.rotary,
        mask_inputs=tuple(zip(mask.values, mask.kinds, strict=True)))


def _scale(score_factors, q_factors, k_factors) -> tuple[float, str]:
    """The factor on Q·Kᵀ and how it is spelled (``score_factors``: (factor, "div"|"mul"))."""
    scale = math.prod(f for f, _ in score_factors) * math.prod(q_factors) * math.prod(k_factors)
    forms = []
    if q_factors and k_factors:
        forms.append("split_qk")
    elif q_factors:
        forms.append("scaled_q")
    elif k_factors:
        forms.append("scaled_k")
    if any(kind == "div" for _, kind in score_factors):
        forms.append("div_scores")
    elif score_factors:
        forms.append("mul_scores")
    return float(scale), "+".join(forms) or "none"


def match_onnx_attention(idx: GraphIndex, node: onnx.NodeProto) -> AttentionBlock:
    """An ONNX ``Attention`` node (opset 23+), or raise _Skip with the reason."""
    ins = list(node.input) + [""] * 6
    if any(ins[4:6]) or (len(node.output) > 1 and any(node.output[1:])):
        raise _Skip("Attention with a KV cache (past_key/past_value) is not supported")
    if idx.attr(node, "softcap", 0.0):
        raise _Skip("Attention with softcap is not supported")
    q_heads, kv_heads = idx.attr(node, "q_num_heads"), idx.attr(node, "kv_num_heads")
    q, k, v = (_walk_operand(idx, x) for x in ins[:3])
    q_shape = idx.shape(ins[0]) or ()
    if len(q_shape) == 3:
        if not q_heads:
            raise ModelError(f"Attention node {node.name} has 3-D inputs and no q_num_heads",
                             hint="re-export the model")
        hidden = q_shape[2]
        if not isinstance(hidden, int):
            raise ModelError(f"Attention node {node.name}: hidden size is not static",
                             hint="export with a static hidden size")
        num_heads, head_dim = int(q_heads), hidden // int(q_heads)
    else:
        heads = _heads_from_reshapes(idx, q, node.name) or _heads_from_shape(idx, ins[0])
        if heads is None:
            raise ModelError(f"Attention node {node.name}: cannot determine the head count",
                             hint="export with static head dimensions")
        num_heads, head_dim = heads
    if kv_heads and q_heads and kv_heads != q_heads:
        raise _Skip("grouped-query Attention (kv_num_heads != q_num_heads) is not supported")
    k_shape = idx.shape(ins[1]) or ()
    if len(k_shape) == 4 and isinstance(k_shape[1], int) and k_shape[1] != num_heads:
        raise _Skip("grouped-query Attention (fewer K/V heads) is not supported")
    out, merge_nodes = _walk_merge(idx, node.output[0])
    scale = idx.attr(node, "scale", None) or 1.0 / math.sqrt(head_dim)
    mask = classify_mask(idx, [ins[3]] if ins[3] else [], [], onnx_op=True)
    causal = bool(idx.attr(node, "is_causal", 0)) or mask.causal
    nodes = [*q.nodes, *k.nodes, *v.nodes, node, *merge_nodes]
    return AttentionBlock(
        layer=-1, num_heads=num_heads, head_dim=head_dim, hidden_size=num_heads * head_dim,
        nodes=idx.in_order(n.name for n in nodes), q_input=q.source, k_input=k.source,
        v_input=v.source, output=out, packed_qkv=q.source == k.source == v.source,
        scale=float(scale), scale_form="onnx_attention", mask_form=mask.form,
        mask_source=mask.source, bias_input=mask.bias_input, softmax_guarded=False,
        causal_in_graph=causal, mask_input=mask.value,
        mask_inputs=tuple(zip(mask.values, mask.kinds, strict=True)))


_CONTRIB_ATTENTION = ("Attention", "MultiHeadAttention", "PackedAttention",
                      "PackedMultiHeadAttention", "GroupQueryAttention", "DecoderAttention")


def _looks_like_attention(idx: GraphIndex, softmax: onnx.NodeProto) -> bool:
    """Scores from a MatMul of two computed operands, over elementwise/layout ops only."""
    return _reaches_scores(idx, softmax.input[0])


def find_attention(idx: GraphIndex) -> tuple[list[AttentionBlock], list[Unsupported]]:
    """Every attention block in graph order, and the candidates left to ONNX Runtime.

    Candidates: ONNX ``Attention`` nodes and every Softmax over a product of two
    computed tensors (Q·Kᵀ-like, through elementwise and layout ops only); other
    Softmax nodes (a classifier's) are simply not attention. ONNX Runtime's contrib attention ops are listed
    as left to ONNX Runtime.
    """
    blocks, skipped = [], []
    for node in idx.nodes:
        if node.domain not in ("", "ai.onnx"):
            if node.op_type in _CONTRIB_ATTENTION:
                skipped.append(Unsupported(node.name, node.op_type, "ONNX Runtime contrib "
                                           f"attention op ({node.domain}) is left to ONNX "
                                           "Runtime"))
            continue
        try:
            if node.op_type == "Softmax" and _looks_like_attention(idx, node):
                blocks.append(match_softmax(idx, node))
            elif node.op_type == "Attention":
                blocks.append(match_onnx_attention(idx, node))
        except _Skip as why:
            skipped.append(Unsupported(node.name, node.op_type, str(why)))
    return blocks, skipped
