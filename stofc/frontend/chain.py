"""Assemble a layer's operator chain around its attention block.

Order of discovery (dataflow only): the Q/K/V projections behind the block's
inputs (behind RoPE too: a RoPE stofc runs, :attr:`~stofc.frontend.types.AttentionBlock.rope_fusion`,
names the values its Rotary op reads, and its nodes, the head splits and the split of a
packed Q|K|V projection included, belong to the attention operator; a RoPE left to
ONNX Runtime is walked through, one packed projection whose parts are split off before
the rotation, ModernBERT's and Phi-3's, counting) and their common input ``h``; a norm producing ``h`` (pre-LN
lead norm); the output projection after the block; the residual Add, whose other
operand says the order (``h``: post-LN; the lead norm's input: pre-LN); then norm, FFN
in, activation (or a gated FFN's ``act(gate) * up`` on the halves of a packed FFN-in
projection, :mod:`stofc.frontend.gated`), FFN out, residual, and (post-LN) the closing
norm. A layer taken for post-LN whose FFN residual adds the un-normed stream is pre-LN
(ModernBERT's first layer, whose attention norm is an Identity).

When a step does not match, the chain stops there and the reason is reported
as :class:`Unsupported` (the rest of the layer is left to ONNX Runtime).
"""

from __future__ import annotations

from stofc.frontend.gated import gated_fwd
from stofc.frontend.graph import GraphIndex
from stofc.frontend.ops import (
    Piece,
    activation_fwd,
    linear_back,
    linear_fwd,
    norm_back,
    norm_fwd,
    residual_fwd,
)
from stofc.frontend.types import AttentionBlock, OpKind, Unsupported


class ChainStop(Exception):
    """The chain cannot be followed further: (node name, op type, reason)."""

    def __init__(self, node: str, op_type: str, reason: str) -> None:
        super().__init__(reason)
        self.unsupported = Unsupported(node, op_type, reason)


def _fused_projections(idx: GraphIndex, block: AttentionBlock) -> tuple[list[Piece], str]:
    """The projections whose results the block's Rotary op reads (its sources)."""
    fusion = block.rope_fusion
    assert fusion is not None
    if fusion.packed:
        value = fusion.sources[0].value
        got = linear_back(idx, value, "qkv")
        width = (block.num_heads + 2 * block.kv_heads) * block.head_dim
        if got is None or got[0][0].params.get("out_features") != width:
            raise ChainStop(_producer(idx, value), _op(idx, value),
                            "the packed Q|K|V value the rotation reads is not a MatMul/Gemm "
                            "with constant weight: the projection is left to ONNX Runtime")
        return got
    pieces, inputs = [], set()
    for role, src in zip("qkv", fusion.sources, strict=True):
        got = linear_back(idx, src.value, role) if src.layout == "bsf" else None
        if got is None:
            raise ChainStop(_producer(idx, src.value), _op(idx, src.value),
                            f"the {role.upper()} projection is not a MatMul/Gemm with constant "
                            "weight read by the rotation (e.g. a per-head norm between them): "
                            "the projections are left to ONNX Runtime")
        pieces.extend(got[0])
        inputs.add(got[1])
    return _from_one_input(idx, block, pieces, inputs)


def _projections(idx: GraphIndex, block: AttentionBlock) -> tuple[list[Piece], str]:
    if block.rope_fusion is not None:
        return _fused_projections(idx, block)
    if block.packed_qkv:
        got = linear_back(idx, block.q_input, "qkv")
        if got is None:
            raise ChainStop(_producer(idx, block.q_input), _op(idx, block.q_input),
                            "the packed QKV projection is not a MatMul/Gemm with constant weight")
        return got
    if block.rope:
        packed = _packed_behind_rope(idx, block)
        if packed is not None:
            return packed
    pieces, inputs = [], set()
    for role, value in (("q", block.q_input), ("k", block.k_input), ("v", block.v_input)):
        got = linear_back(idx, _before_rope(idx, block, value), role)
        if got is None:
            raise ChainStop(_producer(idx, value), _op(idx, value),
                            f"the {role.upper()} projection is not a MatMul/Gemm with constant "
                            "weight")
        pieces.extend(got[0])
        inputs.add(got[1])
    return _from_one_input(idx, block, pieces, inputs)


def _from_one_input(idx: GraphIndex, block: AttentionBlock, pieces: list[Piece],
                    inputs: set[str]) -> tuple[list[Piece], str]:
    """``pieces`` and the one hidden state Q, K and V are projected from (ChainStop when
    they come from several: cross-attention, a bottleneck)."""
    if len(inputs) != 1:
        raise ChainStop(_producer(idx, block.q_input), _op(idx, block.q_input),
                        "Q, K and V are projected from different inputs (cross-attention or a "
                        "bottleneck)")
    return pieces, inputs.pop()


def _before_rope(idx: GraphIndex, block: AttentionBlock, value: str) -> str:
    """The projection output behind a RoPE'd Q/K operand (``value`` itself when unrotated).

    RoPE reads the head-split projection (Reshape, Transpose); those and the rotation
    stay with ONNX Runtime, the projection GEMM before them is the chain's. Only a
    Reshape/Transpose read by nothing else is walked through.
    """
    rotary = next((r for r in block.rope if r.output == value), None)
    if rotary is None:
        return value
    value = rotary.input
    node = idx.produced_by(value)
    while node is not None and node.op_type in ("Reshape", "Transpose") \
            and len(idx.data_users(node.input[0])) == 1:
        value = node.input[0]
        node = idx.produced_by(value)
    return value


_VIEWS = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Split", "Slice", "Gather",
          "Identity")


def _behind_views(idx: GraphIndex, value: str) -> str:
    """The value behind the head split of ``value``: Reshape/Transpose/(Un)squeeze, and the
    Split, Slice or Gather taking one part of a packed projection (their data input)."""
    node = idx.produced_by(value)
    for _ in range(12):
        if node is None or node.op_type not in _VIEWS:
            break
        value = node.input[0]
        node = idx.produced_by(value)
    return value


def _packed_behind_rope(idx: GraphIndex, block: AttentionBlock
                        ) -> tuple[list[Piece], str] | None:
    """The one packed Q|K|V projection behind RoPE'd Q/K and V (ModernBERT's ``Wqkv``,
    Phi-3's ``qkv_proj``): its pieces (role ``qkv``) and input, or None.

    The head split, the parts' Split/Slice and the rotation between it and the attention
    stay with ONNX Runtime; the projection is the chain's when Q, K and V all come from
    it and its width is (H + 2 Hkv) D.
    """
    values = {_behind_views(idx, _before_rope(idx, block, v))
              for v in (block.q_input, block.k_input, block.v_input)}
    if len(values) != 1:
        return None
    got = linear_back(idx, values.pop(), "qkv")
    width = (block.num_heads + 2 * block.kv_heads) * block.head_dim
    if got is None or got[0][0].params.get("out_features") != width:
        return None
    return got


def _producer(idx: GraphIndex, value: str) -> str:
    node = idx.produced_by(value)
    return node.name if node is not None else value


def _op(idx: GraphIndex, value: str) -> str:
    node = idx.produced_by(value)
    return node.op_type if node is not None else "input"


def _first_user(idx: GraphIndex, value: str) -> tuple[str, str]:
    users = idx.users(value)
    return (users[0].name, users[0].op_type) if users else (value, "output")


def build_chain(idx: GraphIndex, block: AttentionBlock
                ) -> tuple[str, list[Piece], list[Unsupported]]:
    """(norm order, the chain's pieces in order, why parts of the layer are left to ORT).

    When the projections do not match (RoPE, a bottleneck ...), the chain starts
    at the attention and the rest of the layer is still followed.
    """
    fusion = block.rope_fusion
    reads = (block.q_input, block.k_input, block.v_input) if fusion is None else (
        *(s.value for s in fusion.sources), fusion.cos, fusion.sin, fusion.position_ids)
    attention = Piece(OpKind.ATTENTION, "", [idx.by_name[n] for n in (
                          *block.nodes, *(fusion.nodes if fusion else ()))],
                      {"layer": block.layer},
                      inputs=tuple(dict.fromkeys(
                          v for v in (*reads, *(m for m, _ in block.mask_inputs)) if v)),
                      outputs=(block.output,))
    stops: list[Unsupported] = []
    try:
        proj, h = _projections(idx, block)
    except ChainStop as stop:
        proj, h = [], None
        reason = stop.unsupported
        if block.rotary and fusion is None:
            reason = Unsupported(reason.node, reason.op_type,
                                 "rotary position embedding (RoPE) on Q/K: the projections and "
                                 f"RoPE are left to ONNX Runtime ({block.rope_refusal})")
        stops.append(reason)
    if h is not None and block.rope and fusion is None:
        split = " (and the split of the packed Q|K|V projection)" if any(
            p.role == "qkv" for p in proj) else ""
        stops.append(Unsupported(block.rope[0].nodes[-1] if block.rope[0].nodes else
                                 block.rope[0].output, "RoPE",
                                 "rotary position embedding (RoPE) on Q/K: the rotation"
                                 f"{split} between the projections and the attention is left "
                                 f"to ONNX Runtime ({block.rope_refusal})"))
    lead = norm_back(idx, h) if h is not None else None
    pieces: list[Piece] = [*proj, attention]
    order = "post"
    try:
        got = linear_fwd(idx, block.output, "out")
        if got is None:
            raise ChainStop(*_first_user(idx, block.output),
                            "no output projection (MatMul/Gemm with constant weight) after "
                            "attention")
        pieces.extend(got[0])
        res = _residual(idx, got[1], h, lead)
        sandwich = norm_fwd(idx, got[1]) if res is None else None
        if sandwich is not None:  # Gemma: out-proj, norm, then the residual Add
            res = _residual(idx, sandwich[1], h, lead)
            if res is not None:
                pieces.append(sandwich[0])
        if res is None:
            scale = idx.sole_data_user(got[1])
            layer_scale = scale is not None and scale.op_type == "Mul" and any(
                idx.is_initializer_like(i) for i in scale.input)
            raise ChainStop(*_first_user(idx, got[1]),
                            "a per-channel scale (LayerScale) before the residual is not "
                            "supported" if layer_scale else
                            "a norm between the output projection and the residual whose "
                            "result is not added to the layer input" if sandwich else
                            "no residual Add of the layer input after the output projection")
        piece, value, other = res
        if lead is not None and other == lead[1]:
            order = "pre"
            pieces.insert(0, lead[0])
        elif h is None and norm_fwd(idx, other) is not None:
            order = "pre"  # the stream also feeds a norm: the (unmatched) lead norm
        pieces.append(piece)
        order = _ffn(idx, value, order, pieces)
    except ChainStop as stop:
        stops.append(stop.unsupported)
    return order, pieces, stops


def _residual(idx: GraphIndex, value: str, h: str | None, lead):
    if h is not None:
        return residual_fwd(idx, value, (h, lead[1]) if lead else (h,))
    others = tuple(i for u in idx.users(value) if u.op_type == "Add" for i in u.input
                   if i != value and idx.const(i) is None and not idx.is_initializer_like(i))
    return residual_fwd(idx, value, others) if others else None


def _linear_users(idx: GraphIndex, value: str) -> int:
    count = 0
    for user in idx.data_users(value):
        if user.op_type in ("Reshape", "Flatten"):
            user = idx.sole_data_user(user.output[0]) or user
        if user.op_type in ("MatMul", "Gemm") and idx.is_initializer_like(user.input[1]):
            count += 1
    return count


def _ffn(idx: GraphIndex, value: str, order: str, pieces: list[Piece]) -> str:
    """From the first residual's output: norm, FFN, residual (and closing norm if post-LN).

    Appends to ``pieces`` as it goes, so a stop keeps what was matched. Returns the norm
    order, "pre" when a layer taken for post-LN (no lead norm: ModernBERT's first layer,
    whose attention norm is an Identity) adds the FFN to the un-normed stream.
    """
    norm = norm_fwd(idx, value)
    for step in idx.data_users(value) if norm is None else ():
        # OPT flattens the stream to [B*S, hidden]; fp16 T5 clamps it (Clip) before the norm
        if step.op_type in ("Reshape", "Flatten", "Clip"):
            norm = norm_fwd(idx, step.output[0])
            if norm is not None:
                if step.op_type == "Clip":
                    norm[0].nodes.insert(0, step)
                # a Reshape/Flatten stays with ONNX Runtime: the flat stream it makes is
                # read by the norm and by the next residual (OPT), two readers
                value = step.output[0]
                break
    if norm is None:
        raise _stop_with(pieces, idx, value, "no LayerNorm/RMSNorm after the attention residual")
    pieces.append(norm[0])
    normed = norm[1]
    stream = normed if order == "post" else value
    if _linear_users(idx, normed) > 1:
        raise _stop_with(pieces, idx, normed, "two projections read the FFN input and they are "
                         "not the gate and up projections of a gated FFN stofc packs "
                         "(SwiGLU/GeGLU/ReGLU): the FFN is left to ONNX Runtime")
    got = linear_fwd(idx, normed, "ffn_in")
    if got is None:
        raise _stop_with(pieces, idx, normed, "no FFN input projection after the norm")
    pieces.extend(got[0])
    act = activation_fwd(idx, got[1])
    if act is None:  # a gated FFN: act(gate) * up on the halves of the packed projection
        gated = gated_fwd(idx, got[1], int(got[0][0].params["out_features"] or 0))
        if gated is None or isinstance(gated, str):
            raise _stop_with(pieces, idx, got[1], f"{gated}: the gated FFN is left to ONNX "
                             "Runtime" if gated else "FFN activation not recognised")
        act = gated
    pieces.append(act[0])
    out = linear_fwd(idx, act[1], "ffn_out")
    if out is None:
        raise _stop_with(pieces, idx, act[1], "no FFN output projection after the activation")
    pieces.extend(out[0])
    res = residual_fwd(idx, out[1], (stream,))
    post = norm_fwd(idx, out[1]) if res is None else None
    if post is not None:  # sandwich (Gemma): the FFN output is normed before the residual
        res = residual_fwd(idx, post[1], (stream,))
        if res is not None:
            pieces.append(post[0])
    if res is None and order == "post" and post is None:
        res = residual_fwd(idx, out[1], (value,))
        order = "pre" if res is not None else order
    if res is None:
        raise _stop_with(pieces, idx, out[1], "no residual Add after the FFN")
    pieces.append(res[0])
    if order == "post":
        closing = norm_fwd(idx, res[1])
        if closing is None:
            raise _stop_with(pieces, idx, res[1], "no LayerNorm after the FFN residual "
                             "(post-LN layer)")
        pieces.append(closing[0])
    return order


def _stop_with(_pieces, idx, value, reason) -> ChainStop:
    return ChainStop(*_first_user(idx, value), reason)
