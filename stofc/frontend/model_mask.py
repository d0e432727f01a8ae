"""The mask each attention layer of the model computes itself, as a MASKS.md spec node.

Models build their own structured masks in the graph: causal (GPT-2, Llama), sliding
windows (Mistral, Gemma's local layers, ModernBERT's +-W local layers with global ones
every third layer), chunked windows, constant buffers sliced per length (GPT-Neo's
local layers). :func:`model_masks` reads them by *evaluating* every block's mask values
(:attr:`~stofc.frontend.types.AttentionBlock.mask_inputs`, the subgraph behind them
extracted and run by ONNX Runtime's CPU EP) for one sequence of length S with an
all-ones padding mask, at several probe lengths S, then fits MASKS.md families exactly:

* ``dense``, ``causal``, ``sliding:window=W[,causal=true]`` (the band of diagonals);
* ``blocksparse`` with a block-diagonal layout (chunked attention);
* otherwise ``bitmap`` (the mask at the compiled length itself).

The fit is made at the longest probe and must reproduce the evaluated mask at *every*
probe (MASKS.md: a length-S run uses the top-left corner of the L_max mask); a mask that
does not (it depends on the length in another way), differs between heads, or cannot be
evaluated at all while the graph does mask the scores structurally is an error naming
the layer (:class:`~stofc.errors.ModelError`), never a silent ``dense``.

Probe lengths: 8, 40, ``max(97, 2 W + 3)`` for the largest window-like integer constant W
among the mask's ancestors, and the length P of any square constant mask buffer
(``[..., P, P]``, sliced per length: GPT-Neo). After a fit, a probe longer than
``2 w + 3`` is added for every window or chunk ``w`` the fit found, so at least one probe
is longer than any window found (issue 15). Inspection caps the probes at 4099; a compile
caps them at its ``max_seq_len`` and never evaluates the mask at ``max_seq_len`` itself
unless no family fits: the fitted family is then written for ``max_seq_len`` in the compact
format, so memory and time follow the probes, not ``max_seq_len**2``. Only the ``bitmap``
fallback needs the mask at ``max_seq_len``; each evaluation is checked against
:data:`~stofc.masks.limits.MAX_PROBE_BYTES` first (a :class:`~stofc.errors.LimitError`
naming the limit, never an out-of-memory kill).

The padding part (the model's ``attention_mask`` input) is not part of the result:
SparseAttention takes it as its ``key_padding_mask``. Finite additive terms (T5's
relative bias, ALiBi, Swin's folded constant bias) are biases, not masks: only
``-inf``-like values (``<= -1e4``) and False booleans disallow a key.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from stofc.errors import LimitError, ModelError
from stofc.frontend.graph import GraphIndex
from stofc.frontend.types import AttentionBlock, ModelGraph
from stofc.masks.build import build_predicate
from stofc.masks.cli_form import make_family
from stofc.masks.limits import MAX_PROBE_BYTES, PROBE_BYTES_PER_ELEMENT, human
from stofc.masks.spec import ArrayRef, Family, Node

BASE_PROBES = (8, 40)
MAX_PROBE = 4099
MASKED_BELOW = -1e4


class _ProbeFailed(Exception):
    """The model's mask could not be read at one probe length."""


@dataclass(frozen=True)
class LayerMask:
    """One layer's own mask: ``node`` (a MASKS.md node; ``dense`` when the graph has
    no structured mask), ``kind`` (``family`` | ``blocksparse`` | ``bitmap``), a
    one-line ``description`` and the probe lengths it was checked at."""

    layer: int
    node: Node
    kind: str
    description: str
    probes: tuple[int, ...]

    @property
    def dense(self) -> bool:
        return isinstance(self.node, Family) and self.node.name == "dense" \
            and not self.node.causal

    def as_dict(self) -> dict:
        return {"layer": self.layer, "kind": self.kind, "description": self.description,
                "spec": self.node.canonical(), "probes": list(self.probes)}


@dataclass(frozen=True)
class ModelMasks:
    """Every layer's :class:`LayerMask`, in layer order."""

    layers: tuple[LayerMask, ...]

    def node(self, layer: int) -> Node:
        return self.layers[layer].node

    @property
    def structured(self) -> bool:
        """True when any layer masks more than padding."""
        return any(not m.dense for m in self.layers)


def _dense() -> Family:
    return make_family("dense", {}, "model", None)


def model_masks(graph: ModelGraph, max_seq_len: int | None = None) -> ModelMasks:
    """The mask every layer of ``graph`` computes (module doc). ``max_seq_len``: the
    compiled length (every node is exact up to it); None (inspection) probes windows found
    in the graph up to 4099."""
    idx = GraphIndex(graph.model)
    values = sorted({v for layer in graph.layers for v, _ in layer.attention.mask_inputs})
    cap = MAX_PROBE if max_seq_len is None else max_seq_len
    probes = _probe_lengths(idx, values, cap)
    prober = _Prober(idx, graph, values)
    out = []
    for layer in graph.layers:
        out.append(_layer_mask(layer.index, layer.attention, prober, probes, cap,
                               max_seq_len, _onnx_causal(idx, layer.attention)))
    return ModelMasks(tuple(out))


class _Prober:
    """The mask values at one length, evaluated once for every layer, each evaluation
    checked against :data:`~stofc.masks.limits.MAX_PROBE_BYTES` before it runs."""

    def __init__(self, idx: GraphIndex, graph: ModelGraph, values: list[str]) -> None:
        self.idx, self.graph, self.values = idx, graph, values
        self.results: dict[int, dict[str, np.ndarray] | None] = {}
        self.session: Any = None
        self.inputs: list = []
        self.built = False

    def at(self, s: int) -> dict[str, np.ndarray] | None:
        if s not in self.results:
            need = PROBE_BYTES_PER_ELEMENT * s * s * max(1, len(self.values))
            if need > MAX_PROBE_BYTES:
                raise LimitError(f"reading the model's own mask at length {s} needs about "
                                 f"{human(need)}, above the {human(MAX_PROBE_BYTES)} limit",
                                 hint="compile a shorter --max-seq-len (limit: "
                                      "stofc.masks.limits.MAX_PROBE_BYTES)")
            if not self.built:
                self.session, self.inputs = _probe_session(self.idx, self.graph, self.values)
                self.built = True
            self.results[s] = _evaluate(self.session, self.inputs, self.values, s)
        return self.results[s]


def _onnx_causal(idx: GraphIndex, block: AttentionBlock) -> bool:
    for name in block.nodes:
        node = idx.by_name.get(name)
        if node is not None and node.op_type == "Attention" and idx.attr(node, "is_causal", 0):
            return True
    return False


def _probe_lengths(idx: GraphIndex, values: list[str], cap: int) -> tuple[int, ...]:
    """8, 40, ``max(97, 2 W + 3)`` for the largest window-like integer constant W and the
    length of every square constant buffer among the mask's ancestors, all ``<= cap``."""
    window, buffers = 0, set()
    for value in values:
        for node in idx.ancestors(value, through_shape=True, limit=300):
            for i in node.input:
                c = idx.const(i) if i else None
                if c is None:
                    continue
                if c.size == 1 and np.issubdtype(c.dtype, np.integer):
                    w = abs(int(c.reshape(-1)[0]))
                    if 2 <= w < cap:
                        window = max(window, w)
                elif (c.ndim >= 3 or c.dtype == np.bool_) and c.ndim >= 2 \
                        and c.shape[-1] == c.shape[-2] > 1:
                    buffers.add(int(c.shape[-1]))  # a mask buffer sliced per length
    wanted = {*BASE_PROBES, max(97, 2 * window + 3), *buffers}
    return tuple(sorted({min(cap, s) for s in wanted if s >= 1}))


def _layer_mask(layer: int, block: AttentionBlock, prober: _Prober, probes: tuple[int, ...],
                cap: int, max_seq_len: int | None, causal_op: bool) -> LayerMask:
    where = f"layer {layer}"
    if not block.mask_inputs:
        plain = make_family("causal", {}, "model", None) if causal_op else _dense()
        return LayerMask(layer, plain, "family", "causal (Attention is_causal)" if causal_op
                         else "none", ())
    allowed: dict[int, np.ndarray] = {}
    todo = sorted(probes)
    while todo:
        s = todo.pop(0)
        if s in allowed:
            continue
        got = _probe(block, prober, s, where, causal_op, first=not allowed)
        if got is None:
            continue  # the model itself does not run at this length (e.g. its positions)
        allowed[s] = got
        if not todo:  # a probe longer than any window the fit at the longest one found
            width = _fit(allowed[s], s)[3]
            longer = min(cap, 2 * width + 3)
            if longer > s:
                todo.append(longer)
    top = max(allowed)
    node, kind, text, _ = _fit(allowed[top], top)
    for s in sorted(allowed):
        if not np.array_equal(_dense_of(node, top)[:s, :s], allowed[s]):
            raise ModelError(f"{where}: the mask the model computes at length {s} is not the "
                             f"top-left corner of its mask at length {top} ({text})",
                             hint="stofc compiles one mask per layer for every length; "
                                  "report the model to stofc")
    if max_seq_len is None or top >= max_seq_len:
        return LayerMask(layer, node, kind, text, tuple(sorted(allowed)))
    if kind != "bitmap":  # the family as it is at the compiled length (block layouts)
        node, kind, text, _ = _fit(allowed[top], top, length=max_seq_len)
        return LayerMask(layer, node, kind, text, tuple(sorted(allowed)))
    full = _probe(block, prober, max_seq_len, where, causal_op, first=True)
    assert full is not None
    if not np.array_equal(full[:top, :top], allowed[top]):
        raise ModelError(f"{where}: the mask the model computes at length {top} is not the "
                         f"top-left corner of its mask at length {max_seq_len}",
                         hint="stofc compiles one mask per layer for every length; "
                              "report the model to stofc")
    node, kind, text, _ = _fit(full, max_seq_len)
    return LayerMask(layer, node, kind, text, (*sorted(allowed), max_seq_len))


def _probe(block: AttentionBlock, prober: _Prober, s: int, where: str, causal_op: bool, *,
           first: bool) -> np.ndarray | None:
    """The allowed ``[s, s]`` mask of one layer; None when the model does not run at ``s``
    (an error at the first probe)."""
    try:
        results = prober.at(s)
        if results is None:
            raise _ProbeFailed(f"cannot evaluate the mask the model computes at length {s}")
        allowed = _allowed(block, results, s, where)
    except _ProbeFailed as err:
        if first:
            raise ModelError(f"{where}: {err}", hint="report the model to stofc") from None
        return None
    if causal_op:
        allowed &= np.tri(s, dtype=bool)
    return allowed


def _allowed(block: AttentionBlock, results: dict[str, np.ndarray], s: int,
             where: str) -> np.ndarray:
    allowed = np.ones((s, s), dtype=bool)
    for value, kind in block.mask_inputs:
        arr = np.asarray(results[value])
        ok = arr.astype(bool) if kind == "keep" or arr.dtype == np.bool_ else arr > MASKED_BELOW
        if ok.ndim < 2:
            ok = ok.reshape((1,) * (2 - ok.ndim) + ok.shape)
        try:
            ok = np.broadcast_to(ok, (*ok.shape[:-2], s, s))
        except ValueError:
            raise _ProbeFailed(f"the mask value {value} has shape {list(arr.shape)} at length "
                               f"{s}") from None
        flat = ok.reshape(-1, s, s)
        if not (flat == flat[:1]).all():
            raise ModelError(f"{where}: the model's mask differs between heads or batch rows "
                             "with an all-ones padding mask", hint="report the model to stofc")
        allowed &= flat[0]
    return allowed


def _fit(allowed: np.ndarray, n: int, *, length: int | None = None
         ) -> tuple[Node, str, str, int]:
    """(node, kind, description, window) reproducing ``allowed`` (``[n, n]``) exactly, its
    block layout sized for ``length`` (default ``n``); ``window``: the band's width or the
    chunk size the fit found (0 for none), which a longer probe must exceed."""
    length = n if length is None else length
    if allowed.all():
        return _dense(), "family", "none (dense)", 0
    band = _band(allowed)
    if band is not None:
        lo, hi = band
        if lo == 0 and hi >= n - 1:
            return make_family("causal", {}, "model", None), "family", "causal", 0
        if lo == 0:
            return (make_family("sliding", {"window": hi}, "model", None, causal=True), "family",
                    f"sliding window {hi} (causal: 0 <= q-k <= {hi})", hi)
        if lo == -hi:
            return (make_family("sliding", {"window": hi}, "model", None), "family",
                    f"sliding window {hi} (both sides: |q-k| <= {hi})", hi)
    chunk = _chunk(allowed)
    if chunk is not None:
        size, causal = chunk
        layout = np.eye(-(-length // size), dtype=bool)
        node = Family("blocksparse", (("block", size), ("layout", _array(layout))),
                      causal=causal)
        return (node, "blocksparse",
                f"chunked, chunks of {size}" + (" (causal)" if causal else ""), size)
    return (Family("bitmap", (("file", _array(allowed)),)), "bitmap",
            f"bitmap {n}x{n} (density {allowed.mean():.3f}; no MASKS.md family fits)", 0)


def _band(allowed: np.ndarray) -> tuple[int, int] | None:
    """(lo, hi) when exactly the diagonals lo <= q-k <= hi are allowed."""
    n = allowed.shape[0]
    full = []
    for d in range(-(n - 1), n):
        diag = np.diagonal(allowed, offset=-d)
        if diag.all():
            full.append(d)
        elif diag.any():
            return None
    if not full or full != list(range(full[0], full[-1] + 1)):
        return None
    return full[0], full[-1]


def _chunk(allowed: np.ndarray) -> tuple[int, bool] | None:
    n = allowed.shape[0]
    col = allowed[:, 0]
    size = int(np.argmin(col)) if not col.all() else n
    if size < 2 or size >= n:
        return None
    q = np.arange(n)
    same = (q[:, None] // size) == (q[None, :] // size)
    for causal in (False, True):
        want = same & (q[None, :] <= q[:, None]) if causal else same
        if np.array_equal(allowed, want):
            return size, causal
    return None


def _array(arr: np.ndarray) -> ArrayRef:
    arr = np.ascontiguousarray(arr, dtype=bool)
    arr.flags.writeable = False
    digest = hashlib.sha256(f"{arr.shape}".encode() + arr.tobytes()).hexdigest()
    return ArrayRef(sha256=digest, shape=tuple(int(s) for s in arr.shape),
                    path="<model's own mask>", data=arr)


def _dense_of(node: Node, n: int) -> np.ndarray:
    q = np.arange(n, dtype=np.int64)
    return np.broadcast_to(build_predicate(node, n, 64).allowed(q[:, None], q[None, :]),
                           (n, n))


def _probe_session(idx: GraphIndex, graph: ModelGraph, values: list[str]) -> tuple[Any, list]:
    """An ONNX Runtime CPU session of the subgraph behind ``values`` (built once, run at
    every probe length) and the graph inputs it needs; (None, []) when it does not load."""
    import onnxruntime as ort  # optional: ONNX Runtime

    nodes = {n.name: n for v in values for n in idx.ancestors(v, through_shape=True,
                                                               limit=1 << 20)}
    ordered = [n for n in idx.nodes if n.name in nodes]
    needed = {i for n in ordered for i in n.input if i}
    inputs = [vi for vi in graph.model.graph.input
              if vi.name in needed and vi.name not in idx.initializers]
    inits = [t for t in graph.model.graph.initializer if t.name in needed]
    outs = [onnx.helper.make_tensor_value_info(v, idx.elem_type(v) or onnx.TensorProto.FLOAT,
                                               None) for v in values]
    sub = onnx.helper.make_graph(ordered, "stofc_mask_probe", inputs, outs, inits)
    model = onnx.helper.make_model(sub, opset_imports=list(graph.model.opset_import),
                                   ir_version=graph.model.ir_version)
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 4
        return ort.InferenceSession(model.SerializeToString(), so,
                                    providers=["CPUExecutionProvider"]), inputs
    except Exception:
        return None, []


def _evaluate(session: Any, inputs: list, values: list[str],
              s: int) -> dict[str, np.ndarray] | None:
    """Every mask value for batch 1, length ``s``, all-ones padding (ORT CPU)."""
    if session is None:
        return None
    feeds = {}
    for vi in inputs:
        feed = _feed(vi, s)
        if feed is None:
            return None
        feeds[vi.name] = feed
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            results = session.run(values, feeds)
    except Exception:
        return None
    return dict(zip(values, (np.asarray(r) for r in results), strict=True))


def _feed(vi: onnx.ValueInfoProto, s: int) -> np.ndarray | None:
    tt = vi.type.tensor_type
    try:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
    except Exception:
        return None
    dims = [d.dim_value if d.HasField("dim_value") else (1 if i == 0 else s)
            for i, d in enumerate(tt.shape.dim)]
    if np.issubdtype(dtype, np.floating):
        return np.zeros(dims, dtype=dtype)
    if "position" in vi.name.lower() and len(dims) == 2:
        return np.broadcast_to(np.arange(s, dtype=dtype), dims).copy()
    return np.ones(dims, dtype=dtype)
