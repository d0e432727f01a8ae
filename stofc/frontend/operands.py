"""Walk back from a Q·Kᵀ or P·V operand to the value SparseAttention reads, and its layout.

From a MatMul operand the walk passes layout ops (Transpose, Reshape, Split/Slice/
Gather of a packed QKV, Squeeze/Unsqueeze, Cast), constant scale factors (Mul/Div)
and an exported ``repeat_kv`` (Unsqueeze + Expand + Reshape of K/V heads: GQA), and
stops at:

* the projection output, flat ``[B, S, H*D]`` (BERT, GPT-2, V of Llama);
* a RoPE output (:mod:`stofc.frontend.rotary`), 4-D, e.g. ``[B, H, S, D]``;
* any other 4-D value after the head split (a per-head norm, ...).

:func:`operand_layout` then says how the stop value is laid out (``bsf``, ``bshd``,
``bhsd``) and how many heads it holds, from the ops between the head-split Reshape and
it (transposes composed), or from its static shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx

from stofc.errors import ModelError
from stofc.frontend.graph import GraphIndex
from stofc.frontend.rotary import find_rotary
from stofc.frontend.types import Rotary

_PASS = ("Transpose", "Cast", "Identity", "Squeeze", "Unsqueeze", "Split", "Slice", "Reshape")


class OperandError(Exception):
    """The operand cannot be read by SparseAttention: carries the reason."""


@dataclass
class Operand:
    """The result of walking back from a MatMul operand to its projection."""

    source: str                       # projected value (after bias) feeding the head split
    nodes: list[onnx.NodeProto]
    head_split: onnx.NodeProto | None  # the Reshape [.., hidden] -> [.., H, D]
    factors: list[float]              # constant scale factors met on the way
    rotary: Rotary | None = None      # stopped at a rotary position embedding (RoPE)
    expanded: bool = False            # passed an exported repeat_kv (Expand of K/V heads)


def target(idx: GraphIndex, reshape: onnx.NodeProto) -> list[int | None] | None:
    """The Reshape's output dims (ints where known), from its shape input or inference."""
    tgt = idx.partial(reshape.input[1])
    inferred = idx.shape(reshape.output[0])
    if tgt is None:
        return None if inferred is None else [d if isinstance(d, int) else None
                                              for d in inferred]
    if inferred is not None and len(inferred) == len(tgt):
        tgt = [t if t is not None and t > 0 else (i if isinstance(i, int) else t)
               for t, i in zip(tgt, inferred, strict=False)]
    return tgt


def is_head_split(idx: GraphIndex, reshape: onnx.NodeProto) -> bool:
    """[.., hidden] -> [.., H, D] (or [.., 3, H, D]): the input's last dim is split."""
    in_shape, tgt = idx.shape(reshape.input[0]), target(idx, reshape)
    if in_shape is None or tgt is None or len(tgt) <= len(in_shape):
        return False
    tail, hidden = tgt[len(in_shape) - 1:], in_shape[-1]
    if not isinstance(hidden, int):
        return False  # e.g. [B*H, D, S] -> [B, H, D, S]: a K transpose detour, not a split
    sizes = [t for t in tail if isinstance(t, int) and t > 0]
    if len(sizes) == len(tail):
        return math.prod(sizes) == hidden
    # a head count computed at run time: still the split if D divides the hidden size
    return len(tgt) >= 4 and isinstance(tail[-1], int) and tail[-1] > 0 \
        and hidden % tail[-1] == 0


def _is_repeat(idx: GraphIndex, node: onnx.NodeProto) -> bool:
    """An Expand broadcasting a size-1 axis of a rank-5 K/V (repeat_kv's n_rep axis)."""
    shape = idx.shape(node.input[0])
    return shape is not None and len(shape) == 5 and shape[2] == 1


def walk_operand(idx: GraphIndex, value: str) -> Operand:
    """Back from a MatMul operand over layout ops and scale factors (module doc)."""
    nodes, factors, head_split, expanded = [], [], None, False
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
        elif op == "Expand" and _is_repeat(idx, node):
            expanded = True
        elif op == "Reshape" and is_head_split(idx, node):
            head_split = node
        elif op not in _PASS:
            break
        nodes.append(node)
        value = nxt
    return Operand(value, nodes, head_split, factors, find_rotary(idx, value), expanded)


def find_head_split(idx: GraphIndex, value: str) -> onnx.NodeProto | None:
    """The nearest head-split Reshape among the ancestors (through RoPE and the like)."""
    for node in idx.ancestors(value, limit=60):
        if node.op_type == "Reshape" and is_head_split(idx, node):
            return node
    return None


def heads_from_reshape(idx: GraphIndex, node: onnx.NodeProto | None,
                       where: str) -> tuple[int, int] | None:
    """(heads, head_dim) from a head-split Reshape's target shape, if one is given.

    A ``-1`` head count is the input width over the other split dims (ModernBERT's
    ``[B, S, 3, -1, D]`` has ``192 / (3 * 32) = 2`` heads, not 6).
    """
    if node is None:
        return None
    in_shape = idx.shape(node.input[0]) or ()
    tgt = target(idx, node) or [None, None]
    heads, dim = tgt[-2], tgt[-1]
    if heads == -1 and dim and in_shape and isinstance(in_shape[-1], int):
        others = tgt[len(in_shape) - 1:-2]
        if all(isinstance(t, int) and t > 0 for t in others):
            heads = in_shape[-1] // (dim * math.prod(others))  # type: ignore[arg-type]
    if heads is None or heads <= 0 or dim is None or dim <= 0:
        raise ModelError(
            f"attention at node {where}: the head count is not a constant (reshape "
            f"{node.name} splits heads with a shape computed at run time)",
            hint="export the model with a fixed number of heads")
    return int(heads), int(dim)


def _trace_labels(idx: GraphIndex, value: str, depth: int = 0) -> list[str] | None:
    """Axis labels (b, s, h, d) of a 4-D value after the head split, from the ops."""
    node = idx.produced_by(value)
    if node is None or depth > 40:
        return None
    op = node.op_type
    if op == "Reshape" and is_head_split(idx, node):
        rank = len(target(idx, node) or ())
        return ["b", "s", "h", "d"] if rank == 4 else (["b", "s", "x", "h", "d"]
                                                       if rank == 5 else None)
    rope = find_rotary(idx, value)
    if rope is not None:
        return _trace_labels(idx, rope.input, depth + 1)
    if op == "Transpose":
        inner = _trace_labels(idx, node.input[0], depth + 1)
        perm = idx.attr(node, "perm")
        if inner is None or perm is None or len(perm) != len(inner):
            return None
        return [inner[p] for p in perm]
    if op in ("Squeeze", "Split", "Gather", "Slice", "Unsqueeze"):
        inner = _trace_labels(idx, node.input[0], depth + 1)
        if inner is None or "x" not in inner:
            return inner if op in ("Split", "Slice") else None
        if op in ("Split", "Slice"):
            return inner
        return [a for a in inner if a != "x"]  # the packed [3] axis taken away
    data = [i for i in node.input if i and idx.const(i) is None
            and idx.rank(i) == idx.rank(value)]
    if op in ("Mul", "Div", "Add", "Sub", "Cast", "Identity", "Pow", "Sqrt", "Reciprocal",
              "ReduceMean", "SimplifiedLayerNormalization", "LayerNormalization",
              "RMSNormalization") and data:
        return _trace_labels(idx, data[0], depth + 1)
    return None


def operand_layout(idx: GraphIndex, op: Operand) -> tuple[str, int | None, int | None]:
    """(layout, heads or None, head_dim or None) of the value the walk stopped at."""
    shape = idx.shape(op.source)
    if shape is None and op.rotary is not None:   # a contrib op shape inference knows not
        shape = idx.shape(op.rotary.input)
    if shape is not None and len(shape) == 3:
        return "bsf", None, None
    labels = _trace_labels(idx, op.source) if shape is None or len(shape) == 4 else None
    if labels is not None and len(labels) == 4 and sorted(labels) == ["b", "d", "h", "s"] \
            and labels[0] == "b" and labels[3] == "d":
        layout = "".join(labels)
    elif shape is not None and len(shape) == 4 and isinstance(shape[3], int):
        ints = [isinstance(shape[1], int), isinstance(shape[2], int)]
        if ints == [True, False]:
            layout = "bhsd"
        elif ints == [False, True]:
            layout = "bshd"
        else:
            raise OperandError(f"cannot tell the head axis of {op.source} (shape {list(shape)})")
    else:
        raise OperandError(f"the attention input {op.source} is neither [B, S, H*D] nor a "
                           "4-D per-head value")
    heads = dim = None
    if shape is not None and len(shape) == 4:
        h = shape[layout.index("h")]
        heads = h if isinstance(h, int) else None
        dim = shape[3] if isinstance(shape[3], int) else None
    return layout, heads, dim
