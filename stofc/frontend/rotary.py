"""Recognise a rotary position embedding (RoPE) applied to a Q or K value.

Forms recognised (names are never looked at, only dataflow):

* rotate-half (Llama, GPT-NeoX): ``x * cos + cat(-x[..., d/2:], x[..., :d/2]) * sin``;
* interleaved (GPT-J): ``x * cos + flatten(stack(-x[..., 1::2], x[..., ::2])) * sin``;
* partial rotary (Phi-3, GPT-NeoX's ``rotary_pct``): ``cat(rope(x[..., :r]), x[..., r:])``;
* ONNX Runtime's ``com.microsoft`` ``RotaryEmbedding`` contrib op.

cos/sin may come from a cache (a Gather from a constant table by position) or be
computed in the graph (Cos/Sin of positions times inverse frequencies); both are
only the other operands of the two Muls here.

In this wave RoPE stays in the graph, run by ONNX Runtime between the projections
and stofc's SparseAttention (whose q/k inputs are the post-RoPE values). The
:class:`~stofc.frontend.types.Rotary` record is the hook for fusing it later into the
QKV GEMM's epilogue or the attention kernel's Q/K load: ``input`` is the pre-RoPE
value, ``cos``/``sin`` the tables, ``form`` and ``rotary_dim`` the arithmetic.
"""

from __future__ import annotations

from dataclasses import replace

import onnx

from stofc.frontend.graph import GraphIndex
from stofc.frontend.types import Rotary

_ROTATE_OPS = {"Slice", "Neg", "Concat", "Split", "Reshape", "Unsqueeze", "Squeeze", "Gather",
               "Transpose", "Mul", "Cast"}


def find_rotary(idx: GraphIndex, value: str) -> Rotary | None:
    """The RoPE whose output is ``value``, or None."""
    node = idx.produced_by(value)
    if node is None:
        return None
    if node.op_type == "RotaryEmbedding":
        interleaved = bool(idx.attr(node, "interleaved", 0))
        dim = int(idx.attr(node, "rotary_embedding_dim", 0)) or None
        return Rotary(value, node.input[0], "interleaved" if interleaved else "rotate_half",
                      dim, "contrib", (node.name,))
    if node.op_type == "Concat" and len(node.input) == 2:
        for r, p in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
            core = _core(idx, r)
            if core is None:
                continue
            base = _slice_source(idx, core.input)
            if base is not None and base == _slice_source(idx, p):
                return replace(core, output=value, input=base, nodes=(
                    *core.nodes, node.name, *_producers(idx, (core.input, p))))
    return _core(idx, value)


def _producers(idx: GraphIndex, values) -> tuple[str, ...]:
    return tuple(n.name for v in values if (n := idx.produced_by(v)) is not None
                 and n.op_type == "Slice")


def _slice_source(idx: GraphIndex, value: str) -> str | None:
    node = idx.produced_by(value, "Slice", "Split")
    return node.input[0] if node is not None else None


def _core(idx: GraphIndex, value: str) -> Rotary | None:
    """``x * cos + rotate(x) * sin`` (operand order free)."""
    add = idx.produced_by(value, "Add")
    if add is None or len(add.input) != 2:
        return None
    muls = [idx.produced_by(i, "Mul") for i in add.input]
    if any(m is None for m in muls):
        return None
    a, b = muls
    assert a is not None and b is not None
    for first, second in ((a, b), (b, a)):
        for x in first.input:
            for rot in second.input:
                found = _rotation(idx, rot, x)
                if found is None:
                    continue
                form, nodes = found
                cos = next(i for i in first.input if i != x)
                sin = next(i for i in second.input if i != rot)
                dim = (idx.shape(x) or (None,))[-1]
                if not isinstance(dim, int):  # the tables' width is the rotated width
                    dim = next((t[-1] for t in (idx.shape(cos), idx.shape(sin))
                                if t and isinstance(t[-1], int) and t[-1] > 1), None)
                tables = "cache" if _from_table(idx, cos) else "computed"
                return Rotary(value, x, form, dim if isinstance(dim, int) else None,
                              tables, (add.name, first.name, second.name, *nodes),
                              cos=cos, sin=sin)
    return None


def _rotation(idx: GraphIndex, rot: str, x: str) -> tuple[str, tuple[str, ...]] | None:
    """(form, nodes) when ``rot`` is rotate_half(x) or the interleaved rotation of x."""
    nodes: list[onnx.NodeProto] = []
    stack, seen, neg, step2 = [rot], set(), False, False
    reached = False
    while stack and len(nodes) < 16:
        v = stack.pop()
        if v == x:
            reached = True
            continue
        node = idx.produced_by(v)
        if node is None or node.op_type not in _ROTATE_OPS:
            return None
        if node.name in seen:
            continue
        seen.add(node.name)
        nodes.append(node)
        if node.op_type == "Neg":
            neg = True
        if node.op_type == "Mul":  # -1 * x
            scalars = [idx.scalar(i) for i in node.input]
            if -1.0 not in scalars:
                return None
            neg = True
        if node.op_type == "Slice" and len(node.input) > 4 and node.input[4]:
            steps = idx.const(node.input[4])
            step2 = step2 or (steps is not None and int(abs(steps.reshape(-1)[0])) == 2)
        stack.extend(i for i in node.input[:1 if node.op_type in ("Slice", "Reshape", "Gather",
                                                                  "Unsqueeze", "Squeeze",
                                                                  "Split", "Transpose")
                                           else None] if i and idx.const(i) is None)
    if not reached or not neg:
        return None
    return ("interleaved" if step2 else "rotate_half"), tuple(n.name for n in nodes)


def _from_table(idx: GraphIndex, value: str) -> bool:
    for node in idx.ancestors(value, limit=12):
        if node.op_type == "Gather" and idx.is_initializer_like(node.input[0]):
            return True
    return False
