"""Matchers for the dense operators around attention: linear layers, norms, activations.

Each matcher starts from a value and follows dataflow; it returns :class:`Piece`
(the ONNX nodes of one chain operator with its parameters) and the value it
produces, or None when the structure is not there. Norms and GELU are matched
as an *elementwise region*: the closure of elementwise/reduction nodes reachable
from the input whose other operands are constants, ending in one value used
outside; the region's contents say what it is (two ReduceMean and a Sub: a
LayerNorm; Pow+ReduceMean without Sub: an RMSNorm; Erf: exact GELU; Tanh: the
tanh approximation). This is indifferent to operand order, Div vs Mul by a
reciprocal, Pow vs x*x, and casts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from stofc.frontend.graph import GraphIndex
from stofc.frontend.types import OpKind

_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Erf", "Tanh",
                "Sigmoid", "ReduceMean", "Cast", "Neg"}
_NORM_OPS = {"LayerNormalization": OpKind.LAYERNORM, "RMSNormalization": OpKind.RMSNORM,
             "SimplifiedLayerNormalization": OpKind.RMSNORM,
             "SkipSimplifiedLayerNormalization": None, "SkipLayerNormalization": None}
# ONNX Runtime's residual Add + norm in one node (input, skip, gamma[, beta]) -> (y, mean,
# inv_std, input + skip): a residual_add and a norm chain op sharing the node
_SKIP_NORM_OPS = {"SkipSimplifiedLayerNormalization": OpKind.RMSNORM,
                  "SkipLayerNormalization": OpKind.LAYERNORM}
_ACT_OPS = {"Relu", "Silu", "Sigmoid", "Tanh", "HardSigmoid", "Elu", "Selu", "LeakyRelu",
            "Mish", "Softplus", "QuickGelu"}


@dataclass
class Piece:
    """One chain operator before it gets its index."""

    kind: OpKind
    role: str
    nodes: list[onnx.NodeProto]
    params: dict = field(default_factory=dict)
    inputs: tuple[str, ...] | None = None   # None: computed from the nodes
    outputs: tuple[str, ...] | None = None


def _learned(idx: GraphIndex, value: str) -> bool:
    return idx.is_initializer_like(value) or idx.const(value) is not None


# ----------------------------------------------------------------------------- linear
def _weight(idx: GraphIndex, value: str, layout: str):
    """(initializer name, layout, extra nodes) of a constant weight, or None."""
    if not idx.is_initializer_like(value):
        return None
    extra = []
    node = idx.produced_by(value, "Transpose")
    if node is not None and list(idx.attr(node, "perm", [1, 0])) == [1, 0]:
        extra.append(node)
        layout = "NK" if layout == "KN" else "KN"
    name = idx.weight_name(value)
    return name, layout, extra


def _gemm_piece(idx: GraphIndex, node: onnx.NodeProto, role: str):
    """(gemm Piece, optional bias Piece, data input) for a MatMul/Gemm with a constant weight."""
    if node.op_type == "MatMul":
        w = _weight(idx, node.input[1], "KN")
        if w is None or idx.is_initializer_like(node.input[0]):
            return None
        name, layout, extra = w
        shape = idx.shape(name) or (None, None)
        k, n = (shape[0], shape[-1]) if layout == "KN" else (shape[-1], shape[0])
        gemm = Piece(OpKind.GEMM, role, [*extra, node],
                     {"in_features": k, "out_features": n, "weight": name,
                      "weight_layout": layout, "fused_bias": False})
        return gemm, None, node.input[0]
    if node.op_type == "Gemm":
        if idx.attr(node, "transA", 0) or idx.attr(node, "alpha", 1.0) != 1.0:
            return None
        layout = "NK" if idx.attr(node, "transB", 0) else "KN"
        w = _weight(idx, node.input[1], layout)
        if w is None:
            return None
        name, layout, extra = w
        shape = idx.shape(name) or (None, None)
        k, n = (shape[0], shape[-1]) if layout == "KN" else (shape[-1], shape[0])
        has_bias = len(node.input) > 2 and bool(node.input[2])
        gemm = Piece(OpKind.GEMM, role, [*extra, node],
                     {"in_features": k, "out_features": n, "weight": name,
                      "weight_layout": layout, "fused_bias": has_bias})
        bias = None
        if has_bias:
            if idx.attr(node, "beta", 1.0) != 1.0 or not _learned(idx, node.input[2]):
                return None
            gemm.inputs, gemm.outputs = (node.input[0],), ()
            bias = Piece(OpKind.BIAS_ADD, role, [node],
                         {"bias": idx.weight_name(node.input[2]), "features": n},
                         inputs=(), outputs=(node.output[0],))
        return gemm, bias, node.input[0]
    return None


def _bias_operand(idx: GraphIndex, node: onnx.NodeProto) -> tuple[str, str] | None:
    """(data input, bias initializer) of an Add of a constant 1-D bias."""
    if node.op_type != "Add":
        return None
    for data, bias in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
        shape = idx.shape(bias)
        if _learned(idx, bias) and not _learned(idx, data) and shape is not None \
                and sum(1 for d in shape if d != 1) <= 1:
            return data, bias
    return None


def linear_back(idx: GraphIndex, value: str, role: str, expect: str | None = None):
    """The projection producing ``value``: ([gemm, bias?] pieces, data input) or None.

    A Reshape to 2-D in front of a Gemm belongs to the projection unless its
    output is ``expect`` (the value the caller starts from).
    """
    node = idx.produced_by(value)
    post = []
    if node is not None and node.op_type == "Reshape":  # 2-D Gemm back to 3-D
        post, value, node = [node], node.input[0], idx.produced_by(node.input[0])
    if node is None:
        return None
    bias = None
    found = _bias_operand(idx, node)
    if found is not None:
        data, b = found
        bias = Piece(OpKind.BIAS_ADD, role, [node], {"bias": idx.weight_name(b),
                                                     "features": _numel(idx, b)})
        node = idx.produced_by(data)
        if node is None:
            return None
    got = _gemm_piece(idx, node, role)
    if got is None:
        return None
    gemm, fused_bias, data = got
    pre = idx.produced_by(data, "Reshape", "Flatten") if node.op_type == "Gemm" else None
    # 3-D -> 2-D in front of a Gemm (possibly shared by the Q, K and V Gemms: then it is
    # listed in each of their gemm ops)
    if pre is not None and data != expect and all(
            u.op_type in ("Gemm", "MatMul") for u in idx.data_users(pre.output[0])):
        gemm.nodes.insert(0, pre)
        data = pre.input[0]
        if gemm.inputs is not None:
            gemm.inputs = (data,)
    pieces = [gemm] + ([fused_bias] if fused_bias else []) + ([bias] if bias else [])
    pieces[-1].nodes.extend(post)
    if post and pieces[-1].outputs is not None:
        pieces[-1].outputs = (post[0].output[0],)
    return pieces, data


def linear_fwd(idx: GraphIndex, value: str, role: str):
    """The projection consuming ``value``: ([gemm, bias?] pieces, output value) or None."""
    for user in idx.users(value):
        mm: onnx.NodeProto | None = user
        if user.op_type in ("Reshape", "Flatten"):
            mm = idx.sole_data_user(user.output[0])
        if mm is None:
            continue
        if mm.op_type not in ("MatMul", "Gemm"):
            continue
        ends = [mm.output[0]]
        nxt = idx.sole_data_user(ends[-1])
        if nxt is not None and nxt.op_type == "Add" and _bias_operand(idx, nxt):
            ends.append(nxt.output[0])
            nxt = idx.sole_data_user(ends[-1])
        if nxt is not None and nxt.op_type == "Reshape":
            ends.append(nxt.output[0])
        for end in reversed(ends):
            got = linear_back(idx, end, role, expect=value)
            if got is not None and got[1] == value:
                return got[0], end
    return None


def _numel(idx: GraphIndex, value: str) -> int | None:
    shape = idx.shape(value)
    dims = [d for d in shape or () if isinstance(d, int)]
    if shape is None or len(dims) != len(shape):
        return None
    n = 1
    for d in dims:
        n *= d
    return n


# ----------------------------------------------------------------------------- regions
def _region(idx: GraphIndex, start: str, limit: int = 24):
    """Elementwise closure from ``start``: (nodes in graph order, the one value used outside)."""
    values, names = {start}, set()
    nodes: list[onnx.NodeProto] = []
    changed = True
    while changed and len(nodes) < limit:
        changed = False
        for v in list(values):
            for user in idx.users(v):
                if user.name in names or user.op_type not in _ELEMENTWISE:
                    continue
                if all(not i or i in values or _learned(idx, i) for i in user.input):
                    names.add(user.name)
                    nodes.append(user)
                    values.update(o for o in user.output if o)
                    changed = True
    if not nodes:
        return None
    outs = [v for v in values - {start}
            if idx.is_graph_output(v) or any(u.name not in names for u in idx.users(v))]
    if len(outs) != 1:
        return None
    return sorted(nodes, key=lambda n: idx.position[n.name]), outs[0]


def _const_operand(idx: GraphIndex, node: onnx.NodeProto) -> str | None:
    for i in node.input:
        if i and _learned(idx, i):
            return i
    return None


def _norm_params(idx: GraphIndex, nodes: list[onnx.NodeProto]) -> dict:
    reduce_outs = {o for n in nodes if n.op_type == "ReduceMean" for o in n.output}
    eps, scale, bias = None, None, None
    for n in nodes:
        c = _const_operand(idx, n)
        if c is None:
            continue
        numel = _numel(idx, c) or 1
        if n.op_type == "Add" and (set(n.input) & reduce_outs) and numel == 1:
            eps = idx.scalar(c)
        elif n.op_type == "Mul" and numel > 1:
            scale = idx.weight_name(c)
        elif n.op_type == "Add" and numel > 1:
            bias = idx.weight_name(c)
    return {"scale": scale, "bias": bias, "epsilon": eps, "form": "decomposed"}


def skip_sum(node: onnx.NodeProto) -> str:
    """The residual sum of a Skip*LayerNormalization node: its output 3, or (unused by the
    model) the virtual value the plan's dataflow names for the residual_add chain op."""
    return node.output[3] if len(node.output) > 3 and node.output[3] else \
        f"{node.name}/{OpKind.RESIDUAL_ADD.value}"


def _skip_norm_of(idx: GraphIndex, value: str) -> onnx.NodeProto | None:
    """The Skip*LayerNormalization whose residual sum is ``value``."""
    stem = value.rsplit("/", 1)[0] if value.endswith(f"/{OpKind.RESIDUAL_ADD.value}") else None
    node = idx.by_name.get(stem) if stem else idx.produced_by(value)
    if node is None or node.op_type not in _SKIP_NORM_OPS or skip_sum(node) != value:
        return None
    return node


def _skip_norm_piece(idx: GraphIndex, node: onnx.NodeProto):
    """The norm half of a Skip*LayerNormalization: (Piece, output) or None (mean/inv_std
    read, or a skip bias: not a plain residual Add + norm)."""
    layer = _SKIP_NORM_OPS[node.op_type] == OpKind.LAYERNORM
    if any(len(node.output) > i and node.output[i] and idx.users(node.output[i])
           for i in (1, 2)) or (len(node.input) > (4 if layer else 3) and node.input[-1]):
        return None
    params = {"scale": idx.weight_name(node.input[2]),
              "epsilon": float(idx.attr(node, "epsilon", 1e-5)), "form": "op"}
    if layer:
        params["bias"] = (idx.weight_name(node.input[3])
                          if len(node.input) > 3 and node.input[3] else None)
    return Piece(_SKIP_NORM_OPS[node.op_type], "", [node], params, inputs=(skip_sum(node),),
                 outputs=(node.output[0],)), node.output[0]


def norm_fwd(idx: GraphIndex, value: str):
    """A LayerNorm/RMSNorm consuming ``value``: (Piece, output) or None."""
    skip = _skip_norm_of(idx, value)
    if skip is not None:
        return _skip_norm_piece(idx, skip)
    for user in idx.users(value):
        kind = _NORM_OPS.get(user.op_type)
        if kind is not None and user.input[0] == value:
            params = {"scale": idx.weight_name(user.input[1]) if len(user.input) > 1 else None,
                      "epsilon": float(idx.attr(user, "epsilon", 1e-5)), "form": "op"}
            if kind == OpKind.LAYERNORM:
                params["bias"] = (idx.weight_name(user.input[2])
                                  if len(user.input) > 2 and user.input[2] else None)
            return Piece(kind, "", [user], params), user.output[0]
    found = _region(idx, value)
    if found is None:
        return None
    nodes, out = found
    ops = [n.op_type for n in nodes]
    if ops.count("ReduceMean") == 2 and "Sub" in ops:
        kind = OpKind.LAYERNORM
    elif ops.count("ReduceMean") == 1 and "Sub" not in ops and ("Pow" in ops or "Mul" in ops):
        kind = OpKind.RMSNORM
    else:
        return None
    params = _norm_params(idx, nodes)
    if kind == OpKind.RMSNORM:
        params.pop("bias")
    return Piece(kind, "", nodes, params), out


def norm_back(idx: GraphIndex, value: str):
    """The norm producing ``value``: (Piece, its input) or None.

    Tries the inputs of the nearby ancestors as the norm's input and keeps the one
    whose region is largest (so leading Casts of fp16 exports belong to the norm).
    """
    node = idx.produced_by(value)
    if node is None:
        return None
    if node.op_type in _SKIP_NORM_OPS:  # the previous layer's residual + this lead norm
        got = _skip_norm_piece(idx, node)
        total = skip_sum(node)
        return (got[0], total) if got and got[1] == value and total in node.output else None
    if node.op_type in _NORM_OPS:
        got = norm_fwd(idx, node.input[0])
        return (got[0], node.input[0]) if got and got[1] == value else None
    best = None
    for anc in idx.ancestors(value, limit=16):
        for cand in anc.input:
            if not cand or _learned(idx, cand):
                continue
            got = norm_fwd(idx, cand)
            if got is not None and got[1] == value and (
                    best is None or len(got[0].nodes) > len(best[0].nodes)):
                best = (got[0], cand)
    return best


def activation_fwd(idx: GraphIndex, value: str):
    """The FFN activation consuming ``value``: (Piece, output) or None."""
    user = idx.sole_data_user(value)
    if user is not None and user.op_type in ("Gelu", "FastGelu", "BiasGelu"):
        approx = idx.attr(user, "approximate", "none")
        approx = approx.decode() if isinstance(approx, bytes) else approx
        if user.op_type == "FastGelu":
            approx = "tanh"
        return Piece(OpKind.GELU, "", [user], {"approximation": approx,
                                               "form": "op"}), user.output[0]
    if user is not None and user.op_type in _ACT_OPS:
        return Piece(OpKind.ACTIVATION, "", [user], {"op": user.op_type}), user.output[0]
    found = _region(idx, value, limit=12)
    if found is None:
        return None
    nodes, out = found
    ops = {n.op_type for n in nodes}
    if "Erf" in ops:
        return Piece(OpKind.GELU, "", nodes, {"approximation": "none", "form": "erf"}), out
    if "Tanh" in ops:
        return Piece(OpKind.GELU, "", nodes, {"approximation": "tanh", "form": "tanh"}), out
    if "Sigmoid" in ops:  # x * sigmoid(a x): QuickGELU (a = 1.702, CLIP) or SiLU (a = 1)
        scalars = (idx.scalar(i) for n in nodes for i in n.input)
        factors = {round(s, 3) for s in scalars if s is not None}
        name = "QuickGelu" if 1.702 in factors else "Silu"
        return Piece(OpKind.ACTIVATION, "", nodes, {"op": name}), out
    return None


def residual_fwd(idx: GraphIndex, value: str, others: tuple[str, ...]):
    """An Add of ``value`` and one of ``others``: (Piece, output, the other) or None."""
    for user in idx.users(value):
        if user.op_type in _SKIP_NORM_OPS and len(user.input) > 2 and _skip_norm_piece(
                idx, user) is not None:
            other = user.input[1] if user.input[0] == value else user.input[0]
            if other in others:
                total = skip_sum(user)
                return Piece(OpKind.RESIDUAL_ADD, "", [user], inputs=(value, other),
                             outputs=(total,) if total in user.output else ()), total, other
            continue
        if user.op_type != "Add" or len(user.input) != 2:
            continue
        other = user.input[1] if user.input[0] == value else user.input[0]
        if other in others:
            return Piece(OpKind.RESIDUAL_ADD, "", [user]), user.output[0], other
        cast = idx.produced_by(other, "Cast")  # fp16 exports cast the stream before the Add
        if cast is not None and cast.input[0] in others and idx.sole_data_user(other) is user:
            return Piece(OpKind.RESIDUAL_ADD, "", [cast, user]), user.output[0], cast.input[0]
    return None
