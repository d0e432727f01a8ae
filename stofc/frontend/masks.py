"""Classify what is added to (or selects) the attention scores, and where it comes from.

* ``mask_source``: the graph input whose *data* flows into the mask (the padding
  mask, usually ``attention_mask``); inputs reached only through ``Shape`` (such as
  ``input_ids`` for the sequence length) do not count.
* A learned relative position bias (T5) is recognised by a ``Gather`` from a
  float embedding table among the mask's ancestors.
* ``causal``: the graph itself masks future positions. Decided by evaluating the
  mask subgraph (onnx's reference evaluator) for one sequence of length 8 with
  an all-ones padding mask: causal when exactly the strict upper triangle is
  masked. When that evaluation cannot run, a ``Trilu`` among the ancestors.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator

from stofc.frontend.graph import GraphIndex

_PROBE_LEN = 8


@dataclass(frozen=True)
class MaskInfo:
    form: str
    source: str | None
    bias_input: str | None
    causal: bool
    value: str | None
    values: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()  # "add" | "keep" per value


def _learned_bias(idx: GraphIndex, value: str) -> bool:
    for node in idx.ancestors(value):
        if node.op_type == "Gather" and idx.is_initializer_like(node.input[0]):
            table = idx.shape(node.input[0]) or ()
            if len(table) == 2 and idx.elem_type(node.input[0]) in (
                    onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16):
                return True
    return False


def _source(idx: GraphIndex, values: list[str]) -> str | None:
    found: set[str] = set()
    for value in values:
        found |= idx.sources(value)
    if not found:
        return None
    masks = sorted(s for s in found if "mask" in s.lower())
    return masks[0] if masks else sorted(found)[0]


def classify_mask(idx: GraphIndex, additive: list[str], boolean: list[str],
                  onnx_op: bool = False) -> MaskInfo:
    """Form, padding-mask source, bias value and causality of the score masks."""
    forms = []
    bias_input = None
    kept = []
    for value in additive:
        learned = _learned_bias(idx, value)
        sourced = bool(idx.sources(value))
        probe = _probe_cached(idx, value)
        is_bool = idx.elem_type(value) == onnx.TensorProto.BOOL
        if not learned and not sourced and probe is not None and _all_zero(probe, is_bool):
            continue  # an all-zero mask the exporter added: no mask at all
        kept.append(value)
        if onnx_op and is_bool:
            forms.append("boolean")
        elif learned:
            bias_input = value
            forms.append("relative_bias+additive" if sourced else "relative_bias")
        elif probe is not None and not is_bool and not _binary(probe):
            bias_input = value
            forms.append("bias")
        else:
            forms.append("additive")
    for value in boolean:
        probe = _probe_cached(idx, value)
        if not idx.sources(value) and probe is not None and _allows_all(probe, True):
            continue
        kept.append(value)
        forms.append("boolean_where")
    causal = any(_causal(idx, v, is_bool=v in boolean) for v in kept)
    kinds = tuple("keep" if v in boolean or idx.elem_type(v) == onnx.TensorProto.BOOL else "add"
                  for v in kept)
    return MaskInfo(form="+".join(forms) or "none", source=_source(idx, kept),
                    bias_input=bias_input, causal=causal, value=kept[0] if kept else None,
                    values=tuple(kept), kinds=kinds)


def _all_zero(probe: np.ndarray, is_bool: bool) -> bool:
    """Adds nothing (a folded constant bias, Swin's relative positions, is *not* this)."""
    if is_bool or probe.dtype == np.bool_:
        return bool(np.all(probe.astype(bool)))
    return bool(np.all(probe == 0))


def _allows_all(probe: np.ndarray, is_bool: bool) -> bool:
    return bool(np.all(probe.astype(bool))) if is_bool or probe.dtype == np.bool_ else bool(
        np.all(probe > -1e4))


def _binary(probe: np.ndarray) -> bool:
    """Only 0 (allowed) and large negative (masked) values: a mask, not a bias."""
    p = probe.astype(np.float64)
    return bool(np.all((np.abs(p) < 1e-6) | (p <= -1e4)))


def _probe_cached(idx: GraphIndex, value: str) -> np.ndarray | None:
    memo = idx.memo.setdefault("probe", {})
    if value not in memo:
        memo[value] = _probe(idx, value)
    return memo[value]


def _causal(idx: GraphIndex, value: str, *, is_bool: bool) -> bool:
    memo = idx.memo.setdefault("causal", {})
    if value not in memo:
        probe = _probe_cached(idx, value)
        if probe is None:
            memo[value] = any(n.op_type == "Trilu" for n in idx.ancestors(value,
                                                                           through_shape=True))
        else:
            memo[value] = _is_causal(probe, is_bool or probe.dtype == np.bool_)
    return memo[value]


def _is_causal(mask: np.ndarray, is_bool: bool) -> bool:
    if mask.ndim < 2 or mask.shape[-1] != _PROBE_LEN or mask.shape[-2] != _PROBE_LEN:
        return False
    m = mask.reshape(-1, _PROBE_LEN, _PROBE_LEN)
    allowed = m.astype(bool) if is_bool else m > -1e4
    upper = np.triu(np.ones((_PROBE_LEN, _PROBE_LEN), dtype=bool), 1)
    return bool(np.all(~allowed[:, upper]) and np.all(allowed[:, ~upper]))


def _probe(idx: GraphIndex, value: str) -> np.ndarray | None:
    """Evaluate ``value`` for batch 1, length 8, all-ones padding mask (None if impossible)."""
    nodes = idx.ancestors(value, through_shape=True, limit=600)
    if len(nodes) >= 600 or any(n.domain not in ("", "ai.onnx") for n in nodes):
        return None
    names = {n.name for n in nodes}
    ordered = [n for n in idx.nodes if n.name in names]
    needed = {i for n in ordered for i in n.input if i}
    graph = idx.model.graph
    feeds = {}
    inputs = []
    for vi in graph.input:
        if vi.name not in needed or vi.name in idx.initializers:
            continue
        feed = _feed(vi)
        if feed is None:
            return None
        feeds[vi.name] = feed
        inputs.append(vi)
    inits = [t for t in graph.initializer if t.name in needed]
    out = onnx.helper.make_tensor_value_info(value, onnx.TensorProto.UNDEFINED, None)
    sub = onnx.helper.make_graph(ordered, "mask_probe", inputs, [out], inits)
    model = onnx.helper.make_model(sub, opset_imports=list(idx.model.opset_import),
                                   ir_version=idx.model.ir_version)
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            outputs = ReferenceEvaluator(model).run(None, feeds)
    except Exception:
        return None
    return np.asarray(outputs[0]) if isinstance(outputs, list) else None


def _feed(vi: onnx.ValueInfoProto) -> np.ndarray | None:
    tt = vi.type.tensor_type
    dims = []
    for i, d in enumerate(tt.shape.dim):
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        else:
            dims.append(1 if i == 0 else _PROBE_LEN)
    try:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
    except Exception:
        return None
    return np.ones(dims, dtype=dtype)
