"""Map each segment of a fusion scheme to a kernel family, or say why none can run it.

Families and the operator sequences they execute (``?`` optional, in order):

* ``attention``  — the attention operator alone (the MHA segment is fixed);
* ``gemm``       — gemm, bias?, activation?, residual_add?
* ``gemm_norm``  — gemm, bias?, residual_add?, layernorm|rmsnorm (the tile
  spans the full row: ``out_features <= MAX_NORM_WIDTH``)
* ``gemm_gemm``  — gemm, bias?, activation?, gemm, bias?, activation?,
  residual_add?, layernorm|rmsnorm? (the second GEMM reads the first one's
  result, kept on chip; with a norm, or split over the hidden dimension, the
  second GEMM's fp32 partial sums go through an Add+Norm pass)
* ``add_norm``   — bias?, activation?, residual_add?, layernorm|rmsnorm?
  (memory-bound, one pass; at least one operator)
* ``ort``        — one activation no template implements (QuickGelu, SiLU, ...):
  ONNX Runtime runs the model's own nodes for it, the fused segments around it
  read and write its values (the plan never picks a segment it cannot generate)
* ``gemm_glu``   — gemm, bias?, gated: a gated FFN's packed gate/up projection
  (``n0 = 2F``) with ``act(gate) * up`` as its epilogue (SwiGLU, GeGLU, ReGLU;
  :mod:`stofc.kernels.glu`); the epilogue's ``bias`` and ``act`` are the gated
  activation's, the output is ``[tokens, F]``
* ``glu``        — bias?, gated: the gated activation without its GEMM (a split scheme),
  one memory pass from ``[tokens, 2F]`` (``n``) to ``[tokens, F]``

A segment kind that is not a chain of the grammar above (the attention operator, an
activation left to ONNX Runtime, a gated MLP's two GEMMs and product...) is claimed by a
*matcher* registered with :func:`matches`: each is asked, in registration order, before
the chain grammar, and returns its :class:`SegmentMatch`, None (not its kind), or raises
:class:`SchemeRejected`. A new segment kind is one ``@matches`` function (beside its
kernel family, :mod:`stofc.kernels.registry`); nothing here branches on it.

Rules every segment obeys: at most two compute-intensive operators (STOF);
operators form a chain (each reads its predecessor's output; a residual add
reads one value from outside the segment); every value read outside the
segment is one the family stores (the final value, plus the pre-norm value for
norm families).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from stofc.errors import PlanError, RegistryError
from stofc.frontend.types import ChainOp, Layer, OpKind
from stofc.kernels.epilogue import Epilogue
from stofc.plan.dataflow import OpFlow, consumers, resolve_dataflow
from stofc.plan.scheme import FusionScheme

MAX_NORM_WIDTH = 1024
MAX_CI_PER_SEGMENT = 2
_ACT_KINDS = (OpKind.GELU, OpKind.ACTIVATION)
_NORM_KINDS = (OpKind.LAYERNORM, OpKind.RMSNORM)


class SchemeRejected(PlanError):
    """A fusion scheme has a segment no kernel family can execute; ``reason`` says why."""

    def __init__(self, segment: int, ops: tuple[int, ...], reason: str) -> None:
        super().__init__(f"segment {segment} (operators {list(ops)}) cannot run: {reason}",
                         hint="choose another fusion scheme (split the segment)")
        self.segment = segment
        self.ops = ops
        self.reason = reason


@dataclass(frozen=True)
class SegmentMatch:
    """One segment mapped to a family, with the values and weights it binds.

    ``bindings`` are ``(slot, name)`` pairs: activations ``x``, ``residual``,
    ``out``, ``pre_norm_out``; parameters ``w0``/``b0`` (first GEMM),
    ``w1``/``b1`` (second GEMM), ``bias`` (a bias without a GEMM), ``gamma``,
    ``beta``. ``epilogues`` holds one epilogue, two for ``gemm_gemm`` (after
    the first GEMM, after the second).
    """

    ordinal: int
    ops: tuple[int, ...]
    family: str
    epilogues: tuple[Epilogue, ...]
    bindings: tuple[tuple[str, str], ...]
    dims: tuple[tuple[str, int], ...]
    epsilon: float
    roles: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def binding(self, slot: str) -> str | None:
        for key, value in self.bindings:
            if key == slot:
                return value
        return None

    def dim(self, name: str) -> int:
        return dict(self.dims)[name]


@dataclass(frozen=True)
class SegmentOps:
    """What a matcher sees of one segment: its operators, their dataflow and the values'
    readers (chain positions; the layer's output is read at ``len(layer.chain)``)."""

    layer: Layer
    ordinal: int
    idx: tuple[int, ...]
    ops: tuple[ChainOp, ...]
    flows: tuple[OpFlow, ...]
    users: dict[str, tuple[int, ...]]
    max_norm_width: int

    def reject(self, reason: str) -> SchemeRejected:
        return SchemeRejected(self.ordinal, self.idx, reason)


Matcher = Callable[[SegmentOps], "SegmentMatch | None"]
_MATCHERS: dict[str, Matcher] = {}


def matches(kind: str) -> Callable[[Matcher], Matcher]:
    """Decorator: the matcher of segment kind ``kind`` (module doc; loud on a second one)."""
    def wrap(fn: Matcher) -> Matcher:
        if kind in _MATCHERS:
            raise RegistryError(f"segment kind {kind!r} has two matchers "
                                f"({_MATCHERS[kind].__name__} and {fn.__name__})")
        _MATCHERS[kind] = fn
        return fn
    return wrap


@matches("attention")
def _attention(seg: SegmentOps) -> SegmentMatch | None:
    """The attention operator, alone (the MHA segment is fixed)."""
    if not any(o.kind == OpKind.ATTENTION for o in seg.ops):
        return None
    if len(seg.ops) != 1:
        raise seg.reject("the attention operator must be a segment of its own "
                         "(the MHA segment is fixed)")
    flow = seg.flows[seg.idx[0]]
    return SegmentMatch(seg.ordinal, seg.idx, "attention", (), (), (), 0.0,
                        (seg.ops[0].role,), flow.inputs, (flow.output,))


@matches("ort")
def _left_to_ort(seg: SegmentOps) -> SegmentMatch | None:
    """One activation no template implements: ONNX Runtime runs the model's own nodes."""
    if len(seg.ops) != 1 or seg.ops[0].kind not in _ACT_KINDS \
            or activation_of(seg.ops[0]) is not None:
        return None
    flow = seg.flows[seg.idx[0]]
    return SegmentMatch(seg.ordinal, seg.idx, "ort", (), (), (), 0.0, (seg.ops[0].role,),
                        flow.inputs, (flow.output,))


def _gated(seg: SegmentOps, gemm: bool) -> SegmentMatch:
    """A segment ending in a gated operator: ``gemm?, bias?, gated`` (``gemm``: with it)."""
    lead = [OpKind.GEMM] if gemm else []
    if [o.kind for o in seg.ops] not in ([*lead, OpKind.GATED],
                                         [*lead, OpKind.BIAS_ADD, OpKind.GATED]):
        raise seg.reject("a gated activation runs in the epilogue of the GEMM producing its "
                         "gate and up halves (the segment must be gemm, bias?, gated) or alone "
                         "(bias?, gated)")
    flows = [seg.flows[i] for i in seg.idx]
    reason = _chain_reason(list(seg.ops), flows)
    if reason:
        raise seg.reject(reason)
    for flow in flows[:-1]:
        if any(u not in seg.idx for u in seg.users.get(flow.output, ())):
            raise seg.reject(f"value {flow.output!r} (operator #{flow.index}) is read outside "
                             "the segment, but a gated kernel stores only act(gate) * up")
    gated, n = seg.ops[-1], 2 * int(seg.ops[-1].param("features"))
    bias = seg.ops[-2] if seg.ops[-2:-1] and seg.ops[-2].kind == OpKind.BIAS_ADD else None
    bindings, dims = [("x", flows[0].inputs[0])], [("n", n)]
    if gemm:
        gemm_op = seg.ops[0]
        dims = [("k0", int(gemm_op.param("in_features"))),
                ("n0", int(gemm_op.param("out_features")))]
        if dims[1][1] != n:
            raise seg.reject(f"the gated operator halves {n} columns but its GEMM has "
                             f"{dims[1][1]}")
        bindings.append(("w0", str(seg.ops[0].param("weight"))))
    if bias is not None:
        bindings.append(("b0" if gemm else "bias", str(bias.param("bias"))))
    bindings.append(("out", flows[-1].output))
    return SegmentMatch(seg.ordinal, seg.idx, "gemm_glu" if gemm else "glu",
                        (Epilogue(bias=bias is not None, act=str(gated.param("act"))),),
                        tuple(bindings), tuple(dims), 0.0, (seg.ops[0].role,) if gemm else (),
                        (flows[0].inputs[0],), (flows[-1].output,))


@matches("gemm_glu")
def _gated_gemm(seg: SegmentOps) -> SegmentMatch | None:
    """A gated FFN's projection: gemm (gate and up packed, 2F wide), bias?, gated."""
    kinds = {o.kind for o in seg.ops}
    return _gated(seg, gemm=True) if {OpKind.GATED, OpKind.GEMM} <= kinds else None


@matches("glu")
def _gated_alone(seg: SegmentOps) -> SegmentMatch | None:
    """A gated activation without its GEMM (bias?, gated): one memory pass, 2F -> F wide."""
    return _gated(seg, gemm=False) if any(o.kind == OpKind.GATED for o in seg.ops) else None


def activation_of(op: ChainOp) -> str | None:
    """The epilogue activation code for a GELU/ACTIVATION op, or None if unsupported."""
    if op.kind == OpKind.GELU:
        tanh = op.param("approximation") == "tanh" or op.param("form") in ("tanh", "fastgelu")
        return "gelu_tanh" if tanh else "gelu_erf"
    if op.kind == OpKind.ACTIVATION and str(op.param("op", "")).lower() == "relu":
        return "relu"
    return None


def _chain_reason(ops: list[ChainOp], flows: list[OpFlow]) -> str | None:
    inside = {f.output for f in flows}
    for prev, flow in itertools.pairwise(flows):
        if prev.output not in flow.inputs:
            return (f"operator #{flow.index} ({flow.kind.value}) does not read operator "
                    f"#{prev.index}'s output, so they do not form a fusable chain")
        others = [v for v in flow.inputs if v != prev.output]
        if flow.kind == OpKind.RESIDUAL_ADD:
            if any(v in inside for v in others):
                return f"residual add #{flow.index} adds a value produced in the same segment"
        elif others:
            return f"operator #{flow.index} ({flow.kind.value}) reads more than one activation"
    return None


def _parse(ops: list[ChainOp]) -> tuple[list[list[ChainOp]], ChainOp | None, ChainOp | None,
                                         str | None]:
    """Split into GEMM groups (gemm, bias?, act?), residual?, norm?; or a reason."""
    groups: list[list[ChainOp]] = []
    pos, n = 0, len(ops)
    while pos < n and (ops[pos].kind == OpKind.GEMM or (not groups and pos == 0)):
        group: list[ChainOp] = []
        if ops[pos].kind == OpKind.GEMM:
            group.append(ops[pos])
            pos += 1
        if pos < n and ops[pos].kind == OpKind.BIAS_ADD:
            group.append(ops[pos])
            pos += 1
        if pos < n and ops[pos].kind in _ACT_KINDS:
            group.append(ops[pos])
            pos += 1
        if not group:
            break
        groups.append(group)
    residual = norm = None
    if pos < n and ops[pos].kind == OpKind.RESIDUAL_ADD:
        residual, pos = ops[pos], pos + 1
    if pos < n and ops[pos].kind in _NORM_KINDS:
        norm, pos = ops[pos], pos + 1
    if pos < n:
        kinds = " ".join(o.kind.value for o in ops)
        if norm is not None and ops[pos].kind == OpKind.GEMM:
            return groups, residual, norm, (
                "a norm followed by a GEMM would need a norm prologue inside the GEMM, "
                "which no kernel family has")
        return groups, residual, norm, (
            f"no kernel family executes '{kinds}' (order must be gemm, bias, activation, "
            "[gemm, bias, activation,] residual_add, norm)")
    return groups, residual, norm, None


def _match_one(layer: Layer, ordinal: int, idx: tuple[int, ...], flows: tuple[OpFlow, ...],
               users: dict[str, tuple[int, ...]], max_norm_width: int) -> SegmentMatch:
    ops = [layer.chain[i] for i in idx]
    seg_flows = [flows[i] for i in idx]
    view = SegmentOps(layer, ordinal, idx, tuple(ops), flows, users, max_norm_width)
    for matcher in _MATCHERS.values():
        claimed = matcher(view)
        if claimed is not None:
            return claimed
    reject = view.reject
    kinds = [o.kind for o in ops]
    n_ci = sum(k == OpKind.GEMM for k in kinds)
    if n_ci > MAX_CI_PER_SEGMENT:
        raise reject(f"{n_ci} compute-intensive operators; a segment holds at most "
                     f"{MAX_CI_PER_SEGMENT}")
    reason = _chain_reason(ops, seg_flows)
    if reason:
        raise reject(reason)
    groups, residual, norm, reason = _parse(ops)
    if reason:
        raise reject(reason)

    bindings: list[tuple[str, str]] = [("x", seg_flows[0].inputs[0])]
    dims: list[tuple[str, int]] = []
    epilogues: list[Epilogue] = []
    gemms = [g[0] for g in groups if g[0].kind == OpKind.GEMM]
    for gi, group in enumerate(groups):
        bias = act = None
        for op in group:
            if op.kind == OpKind.GEMM:
                bindings.append((f"w{gi}", str(op.param("weight"))))
                dims += [(f"k{gi}", int(op.param("in_features"))),
                         (f"n{gi}", int(op.param("out_features")))]
            elif op.kind == OpKind.BIAS_ADD:
                bias = op
                bindings.append((f"b{gi}" if gemms else "bias", str(op.param("bias"))))
            else:
                act = activation_of(op)
                if act is None:
                    raise reject(f"activation {op.param('op')!r} has no fused implementation "
                                 "(supported: Gelu erf/tanh, Relu)")
        epilogues.append(Epilogue(bias=bias is not None, act=act or "none"))
    if not groups:
        epilogues.append(Epilogue())
    if len(gemms) == 2 and gemms[0].param("out_features") != gemms[1].param("in_features"):
        raise reject("the second GEMM's in_features differ from the first's out_features")
    last = epilogues[-1]
    norm_kind, shift, eps = "none", True, 0.0
    if norm is not None:
        norm_kind = "layernorm" if norm.kind == OpKind.LAYERNORM else "rmsnorm"
        shift = norm.kind == OpKind.LAYERNORM and norm.param("bias") is not None
        eps = float(norm.param("epsilon", 1e-5))
        bindings.append(("gamma", str(norm.param("scale"))))
        if shift:
            bindings.append(("beta", str(norm.param("bias"))))
        if len(gemms) == 1:
            width = int(gemms[-1].param("out_features"))
            if width > max_norm_width:
                raise reject(f"GEMM+{norm_kind} needs a tile spanning the full row "
                             f"(out_features {width} > {max_norm_width})")
    if residual is not None:
        res_flow = flows[residual.index]
        prev_out = flows[residual.index - 1].output if residual.index > idx[0] else None
        other = [v for v in res_flow.inputs if v != prev_out]
        if residual.index == idx[0]:  # segment starts at the add: both inputs external
            bindings[0] = ("x", res_flow.inputs[0])
            other = list(res_flow.inputs[1:])
        bindings.append(("residual", other[0]))

    produced = {f.output: f.index for f in seg_flows}
    final = seg_flows[-1].output
    pre_norm = flows[norm.index].inputs[0] if norm is not None and norm.index > idx[0] else None
    outside = [v for v, pos in produced.items()
               if v != final and any(u not in idx for u in users.get(v, ()))]
    store_pre = False
    for value in outside:
        if value == pre_norm:
            store_pre = True
            continue
        raise reject(f"value {value!r} (operator #{produced[value]}) is read outside the "
                     f"segment, but a fused kernel stores only its final value"
                     + (" and the pre-norm value" if norm is not None else ""))
    epilogues[-1] = Epilogue(bias=last.bias, act=last.act, residual=residual is not None,
                             norm=norm_kind, norm_shift=shift, store_pre_norm=store_pre)
    if epilogues[-1].is_identity and not gemms:
        raise reject("an empty memory-bound segment")
    bindings.append(("out", final))
    outputs = [final]
    if store_pre and pre_norm is not None:
        bindings.append(("pre_norm_out", pre_norm))
        outputs.insert(0, pre_norm)
    family = ("gemm_gemm" if len(gemms) == 2 else
              "gemm_norm" if gemms and norm is not None else
              "gemm" if gemms else "add_norm")
    inputs = tuple(dict.fromkeys(v for f in seg_flows for v in f.inputs if v not in produced))
    return SegmentMatch(ordinal, idx, family, tuple(epilogues), tuple(bindings), tuple(dims),
                        eps, tuple(o.role for o in gemms), inputs, tuple(outputs))


def match_segments(layer: Layer, scheme: FusionScheme, *,
                   max_norm_width: int = MAX_NORM_WIDTH) -> tuple[SegmentMatch, ...]:
    """Map every segment of ``scheme`` to a family; raise :class:`SchemeRejected` if one can't."""
    if len(scheme) != len(layer.chain):
        raise PlanError(f"fusion scheme has {len(scheme)} values for a chain of "
                        f"{len(layer.chain)} operators",
                        hint="give one value per operator of the layer chain")
    flows = resolve_dataflow(layer)
    users = consumers(flows)
    last = flows[-1].output
    users = {**users, last: (*users.get(last, ()), len(flows))}
    return tuple(_match_one(layer, k, seg, flows, users, max_norm_width)
                 for k, seg in enumerate(scheme.segments()))


def reject_reason(layer: Layer, scheme: FusionScheme, *,
                  max_norm_width: int = MAX_NORM_WIDTH) -> str | None:
    """Why ``scheme`` cannot run on ``layer`` (one line), or None if it can."""
    try:
        match_segments(layer, scheme, max_norm_width=max_norm_width)
    except SchemeRejected as err:
        return str(err).split(";")[0]
    return None
