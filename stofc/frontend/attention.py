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

import onnx

from stofc.errors import ModelError
from stofc.frontend.graph import GraphIndex
from stofc.frontend.load import opset_of
from stofc.frontend.masks import classify_mask
from stofc.frontend.operands import (
    Operand,
    OperandError,
    find_head_split,
    heads_from_reshape,
    operand_layout,
    walk_operand,
)
from stofc.frontend.types import AttentionBlock, Unsupported


class _Skip(Exception):
    """This candidate is not an attention we handle: carries the reason."""


def _heads_from_shape(idx: GraphIndex, value: str) -> tuple[int, int] | None:
    shape = idx.shape(value)
    if shape is not None and len(shape) == 4 and isinstance(shape[1], int) \
            and isinstance(shape[3], int):
        return shape[1], shape[3]
    return None


def _softcap(idx: GraphIndex, node: onnx.NodeProto) -> tuple[float, str, list] | None:
    """``cap * tanh(x / cap)`` ending at Mul ``node``: (cap, x, the nodes), or None."""
    if node.op_type != "Mul":
        return None
    for t, c in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
        tanh, cap = idx.produced_by(t, "Tanh"), idx.scalar(c)
        if tanh is None or cap is None or cap <= 0:
            continue
        inner = idx.produced_by(tanh.input[0], "Mul", "Div")
        if inner is None:
            return None
        a, b = inner.input
        sb = idx.scalar(b)
        if sb is None:
            return None
        divisor = sb if inner.op_type == "Div" else (1.0 / sb if sb else 0.0)
        if not math.isclose(divisor, cap, rel_tol=1e-4):
            return None
        return cap, a, [inner, tanh]
    return None


def _walk_scores(idx: GraphIndex, value: str):
    """Back from the Softmax input to Q Kᵀ: (matmul, nodes, factors, mask values,
    where_masks, softcap)."""
    nodes: list[onnx.NodeProto] = []
    factors: list[tuple[float, str]] = []   # (scale, how it was applied)
    additive: list[str] = []                # additive mask values
    boolean: list[str] = []                 # Where conditions
    softcap = 0.0
    for _ in range(16):
        node = idx.produced_by(value)
        if node is None:
            raise _Skip("the Softmax input is not computed from Q·Kᵀ")
        op = node.op_type
        if op == "MatMul":
            if idx.const(node.input[0]) is not None or idx.const(node.input[1]) is not None:
                raise _Skip("the scores come from a MatMul with a constant operand")
            return node, nodes, factors, additive, boolean, softcap
        nodes.append(node)
        capped = _softcap(idx, node) if not softcap else None
        if capped is not None:
            if factors:
                raise _Skip("the scores are scaled after the soft-capping")
            softcap, value = capped[0], capped[1]
            nodes.extend(capped[2])
        elif op in ("Cast", "Identity"):
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
            raise _Skip("a Tanh on the scores that is not cap * tanh(scores / cap)")
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
    nodes: list[onnx.NodeProto] = []
    while True:
        user = idx.sole_data_user(value)
        if user is None or user.op_type not in ("Transpose", "Reshape", "Cast", "Identity"):
            return value, nodes
        nodes.append(user)
        value = user.output[0]
        rank = idx.rank(value)
        if user.op_type == "Reshape" and rank is not None and rank <= 3:
            return value, nodes


def _resolve(idx: GraphIndex, op: Operand, where: str) -> tuple[str, int | None, int | None]:
    """(layout, heads, head_dim) of one operand's stop value (heads from the head split
    when the value is flat)."""
    try:
        layout, heads, dim = operand_layout(idx, op)
    except OperandError as err:
        raise _Skip(str(err)) from None
    if heads is None or dim is None:
        split = op.head_split or (find_head_split(idx, op.source) if layout != "bsf" else None)
        got = heads_from_reshape(idx, split, where)
        if got is not None:
            heads, dim = heads if heads is not None else got[0], dim or got[1]
    return layout, heads, dim


def _narrow(idx: GraphIndex, op: Operand) -> Operand:
    """The operand's own part of a packed projection (ModernBERT's Wqkv, Phi-3's qkv_proj)
    when the others do not read the packed value as SparseAttention's packed q: the first
    value after the packed split (toward the MatMul) of rank 3 or 4."""
    splits = [i for i, n in enumerate(op.nodes) if n.op_type in ("Split", "Slice", "Gather")]
    if not splits:
        return op
    for j in range(splits[-1], -1, -1):
        node = op.nodes[j]
        out = next((o for o in node.output if o and (j == 0 or o in op.nodes[j - 1].input)),
                   node.output[0])
        if idx.rank(out) in (3, 4):
            keep = op.nodes[:j]
            split = op.head_split if op.head_split in keep else None
            return Operand(out, keep, split, op.factors, op.rotary, op.expanded)
    return op


def match_softmax(idx: GraphIndex, softmax: onnx.NodeProto) -> AttentionBlock:
    """The attention block around ``softmax`` (layer=-1), or raise _Skip with the reason."""
    rank = idx.rank(softmax.input[0])
    axis = idx.attr(softmax, "axis", -1 if opset_of(idx.model) >= 13 else 1)
    if rank is not None and axis not in (-1, rank - 1):
        raise _Skip(f"Softmax over axis {axis}, not the key axis")
    qk, score_nodes, factors, additive, boolean, softcap = _walk_scores(idx, softmax.input[0])
    pv, prob_nodes, guarded = _walk_probs(idx, softmax)
    q, k, v = (walk_operand(idx, x) for x in (qk.input[0], qk.input[1], pv.input[1]))
    sources = [o.source for o in (q, k, v)]
    if len(set(sources)) > 1:  # not all three read one packed value: each reads its part
        q, k, v = (_narrow(idx, o) for o in (q, k, v))
    (ql, qh, qd), (kl, kh, kd), (vl, vh, vd) = (_resolve(idx, o, softmax.name)
                                               for o in (q, k, v))
    if qh is None:
        fallback = _heads_from_shape(idx, qk.input[0])
        qh, qd = fallback if fallback else (None, None)
    if qh is None or qd is None:
        raise _Skip("cannot determine the head count (no head-split Reshape of Q and no static "
                    "Q shape)")
    num_heads, head_dim = qh, qd
    kv_heads = kh or vh or num_heads
    for name, heads, dim in (("K", kh, kd), ("V", vh, vd)):
        if heads is not None and heads != kv_heads:
            raise _Skip(f"K has {kh} heads and V {vh}")
        if dim is not None and dim != head_dim:
            raise _Skip(f"{name} has head_dim {dim} and Q {head_dim}")
    if num_heads % kv_heads:
        raise _Skip(f"{num_heads} query heads are not a multiple of {kv_heads} K/V heads")
    if kv_heads != num_heads and not (k.expanded or v.expanded or kl != "bsf" or vl != "bsf"):
        raise _Skip(f"K/V have {kv_heads} heads and Q {num_heads}, but no repeat of the K/V "
                    "heads was found")
    out, merge_nodes = _walk_merge(idx, pv.output[0])
    scale, form = _scale(factors, q.factors, k.factors)
    mask = classify_mask(idx, additive, boolean)
    nodes = [*q.nodes, *k.nodes, *v.nodes, qk, *score_nodes, softmax, *prob_nodes, pv,
             *merge_nodes]
    rope = tuple(o.rotary for o in (q, k) if o.rotary is not None)
    return AttentionBlock(
        layer=-1, num_heads=num_heads, head_dim=head_dim, hidden_size=num_heads * head_dim,
        nodes=idx.in_order(n.name for n in nodes), q_input=q.source, k_input=k.source,
        v_input=v.source, output=out,
        packed_qkv=q.source == k.source == v.source and ql == "bsf",
        scale=scale, scale_form=form, mask_form=mask.form, mask_source=mask.source,
        bias_input=mask.bias_input, softmax_guarded=guarded, causal_in_graph=mask.causal,
        mask_input=mask.value, rotary=bool(rope),
        mask_inputs=tuple(zip(mask.values, mask.kinds, strict=True)),
        kv_num_heads=kv_heads, q_layout=ql, k_layout=kl, v_layout=vl, softcap=softcap,
        rope=rope, kv_expanded=k.expanded or v.expanded)


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
    q, k, v = (walk_operand(idx, x) for x in ins[:3])
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
        heads = (heads_from_reshape(idx, q.head_split, node.name)
                 or _heads_from_shape(idx, ins[0]))
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
    return _one_softmax_each(idx, blocks, skipped)


def _one_softmax_each(idx: GraphIndex, blocks: list[AttentionBlock],
                      skipped: list[Unsupported]
                      ) -> tuple[list[AttentionBlock], list[Unsupported]]:
    """Refuse attentions whose Q, K, V feed several Softmax nodes (HF BigBird's
    block_sparse computes five): one of them is not the whole attention."""
    groups: dict[tuple[str, str, str], list[AttentionBlock]] = {}
    for block in blocks:
        groups.setdefault((block.q_input, block.k_input, block.v_input), []).append(block)
    kept = []
    for block in blocks:
        group = groups[(block.q_input, block.k_input, block.v_input)]
        if len(group) == 1:
            kept.append(block)
            continue
        soft = next(n for n in block.nodes if idx.by_name[n].op_type in ("Softmax", "Attention"))
        skipped.append(Unsupported(soft, idx.by_name[soft].op_type, (
            f"{len(group)} Softmax nodes over one attention's Q, K, V (block-sparse attention "
            "such as HF BigBird's block_sparse): stofc compiles one Softmax per attention; "
            "export with attention_type='original_full' and pass the mask with --mask")))
    return kept, skipped
