"""Gated FFNs (SwiGLU, GeGLU, ReGLU): ``act(gate) * up`` on a packed ``[gate | up]`` value.

A gated FFN projects its input twice, once for the *gate* (activated) and once for
the *up* half, and multiplies them: ``down(act(x Wg) * (x Wu))`` (Llama, Mistral,
Qwen2, Gemma: SiLU or tanh-GELU; ModernBERT: erf-GELU; Phi-3 and ModernBERT pack
``[Wg | Wu]`` into one projection and split its result). Separate projections are
packed at load (:mod:`stofc.frontend.pack_ffn`), so the chain always sees one
projection of width 2F followed by the :data:`~stofc.frontend.types.OpKind.GATED`
operator this module matches.

Contract of :func:`gated_fwd` (on a canonicalized model): from the projection's
output ``value`` (``[..., 2F]``), the halves are a ``Split`` into two equal parts
on the last axis, or two ``Slice`` nodes on the last axis (constant starts/ends,
step 1) covering ``[0, F)`` and ``[F, 2F)``, and nothing else reads ``value``; the
first half feeds an activation stofc fuses (:func:`gate_act`), whose result is
read by one ``Mul`` with the second half, the only reader of that half. The
match covers the split, the activation's nodes and the ``Mul``.
"""

from __future__ import annotations

import numpy as np
import onnx

from stofc.frontend.graph import GraphIndex
from stofc.frontend.ops import Piece, activation_fwd
from stofc.frontend.types import OpKind

GATED_ACTS = ("silu", "gelu_erf", "gelu_tanh", "relu")
_INT_MAX = 2**62

Halves = tuple[list[onnx.NodeProto], str, str]
# (the gated Piece, its output) | a reason it looks gated but is not fused | None: not gated
GatedMatch = tuple[Piece, str] | str | None


def gate_act(piece: Piece) -> str | None:
    """The gated activation code of an activation :class:`Piece` (:data:`GATED_ACTS`), or
    None when no kernel fuses it (QuickGelu, Softplus, ...)."""
    if piece.kind == OpKind.GELU:
        tanh = piece.params.get("approximation") == "tanh" or \
            piece.params.get("form") in ("tanh", "fastgelu")
        return "gelu_tanh" if tanh else "gelu_erf"
    if piece.kind == OpKind.ACTIVATION:
        op = str(piece.params.get("op", "")).lower()
        return op if op in ("silu", "relu") else None
    return None


def _last_axis(axis: int, rank: int | None) -> bool:
    return axis == -1 or (rank is not None and axis == rank - 1)


def _ints(idx: GraphIndex, node: onnx.NodeProto, pos: int, attr: str) -> list[int] | None:
    """Input ``pos`` of ``node`` as constant ints, or its attribute ``attr`` (old opsets)."""
    if len(node.input) > pos and node.input[pos]:
        c = idx.const(node.input[pos])
        return None if c is None else [int(v) for v in np.asarray(c).reshape(-1)]
    got = idx.attr(node, attr)
    return None if got is None else [int(v) for v in got]


def _split_halves(idx: GraphIndex, node: onnx.NodeProto, width: int, rank: int | None
                  ) -> Halves | None:
    outs = [o for o in node.output]
    if len(outs) != 2 or not all(outs) or not _last_axis(int(idx.attr(node, "axis", 0)), rank):
        return None
    sizes = _ints(idx, node, 1, "split")
    if sizes is not None and sizes != [width // 2, width // 2]:
        return None
    return [node], outs[0], outs[1]


def _slice_span(idx: GraphIndex, node: onnx.NodeProto, width: int, rank: int | None
                ) -> tuple[int, int] | None:
    starts, ends = _ints(idx, node, 1, "starts"), _ints(idx, node, 2, "ends")
    axes, steps = _ints(idx, node, 3, "axes"), _ints(idx, node, 4, "steps")
    if starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
        return None
    if axes is None or len(axes) != 1 or not _last_axis(axes[0], rank):
        return None
    if steps is not None and steps != [1]:
        return None
    start, end = (v + width if v < 0 else v for v in (starts[0], min(ends[0], _INT_MAX)))
    return max(0, min(start, width)), max(0, min(end, width))


def halves(idx: GraphIndex, value: str, width: int) -> Halves | None:
    """(split nodes, first half, second half) of ``value`` (``[..., width]``) on its last
    axis, or None (module contract)."""
    users = idx.data_users(value)
    rank = idx.rank(value)
    if width % 2 or idx.is_graph_output(value):
        return None
    if len(users) == 1 and users[0].op_type == "Split":
        return _split_halves(idx, users[0], width, rank)
    if len(users) != 2 or any(u.op_type != "Slice" or u.input[0] != value for u in users):
        return None
    spans = [_slice_span(idx, u, width, rank) for u in users]
    halves_at = [(0, width // 2), (width // 2, width)]
    if spans == halves_at[::-1]:
        users = users[::-1]
    elif spans != halves_at:
        return None
    first, second = users
    return [first, second], first.output[0], second.output[0]


def gated_fwd(idx: GraphIndex, value: str, width: int) -> GatedMatch:
    """The gated operator reading the packed projection ``value`` of ``width`` = 2F
    (module contract): ``(Piece, output)``; a reason string when the halves are there but
    the rest is not a gated FFN stofc fuses; None when ``value`` is not split in halves."""
    found = halves(idx, value, width)
    if found is None:
        return None
    nodes, first, second = found
    act = activation_fwd(idx, first)
    if act is None:
        if activation_fwd(idx, second) is not None:
            return ("gated FFN with the activation on the second half of the packed "
                    "projection (up first) is not supported")
        return "the first half of the packed gate/up projection has no activation"
    piece, act_out = act
    code = gate_act(piece)
    if code is None:
        name = piece.params.get("op", piece.kind.value)
        return (f"gated activation {name} has no fused form (SwiGLU, GeGLU erf/tanh and "
                "ReGLU have)")
    mul = idx.sole_data_user(act_out)
    if mul is None or mul.op_type != "Mul" or sorted(mul.input) != sorted((act_out, second)):
        return "the activated gate half is not multiplied by the up half"
    if [u.name for u in idx.data_users(second)] != [mul.name] or idx.is_graph_output(second):
        return "the up half of the gated FFN is read besides its product with the gate"
    inside = {n.name for n in piece.nodes}
    if any(u.name not in inside for u in idx.data_users(first)):
        return "the gate half of the gated FFN is read besides its activation"
    return Piece(OpKind.GATED, "", [*nodes, *piece.nodes, mul],
                 {"act": code, "features": width // 2}, inputs=(value,)), mul.output[0]
