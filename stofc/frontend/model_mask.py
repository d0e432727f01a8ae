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

Probe lengths: 8, 40 and, for inspection, ``2 W + 3`` for the largest window-like
integer constant W among the mask's ancestors (capped at 4099); a compile probes at its
``max_seq_len`` (exact for every length it will run) plus those below it.

The padding part (the model's ``attention_mask`` input) is not part of the result:
SparseAttention takes it as its ``key_padding_mask``. Finite additive terms (T5's
relative bias, ALiBi, Swin's folded constant bias) are biases, not masks: only
``-inf``-like values (``<= -1e4``) and False booleans disallow a key.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass

import numpy as np
import onnx

from stofc.errors import ModelError
from stofc.frontend.graph import GraphIndex
from stofc.frontend.types import AttentionBlock, ModelGraph
from stofc.masks.build import build_predicate
from stofc.masks.cli_form import make_family
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
    compiled length, probed exactly; None (inspection) probes windows found in the graph."""
    idx = GraphIndex(graph.model)
    values = sorted({v for layer in graph.layers for v, _ in layer.attention.mask_inputs})
    probes = _probe_lengths(idx, values, max_seq_len)
    evaluated = {s: _evaluate(idx, graph, values, s) for s in probes} if values else {}
    out = []
    for layer in graph.layers:
        out.append(_layer_mask(layer.index, layer.attention, evaluated, probes,
                               _onnx_causal(idx, layer.attention)))
    return ModelMasks(tuple(out))


def _onnx_causal(idx: GraphIndex, block: AttentionBlock) -> bool:
    for name in block.nodes:
        node = idx.by_name.get(name)
        if node is not None and node.op_type == "Attention" and idx.attr(node, "is_causal", 0):
            return True
    return False


def _probe_lengths(idx: GraphIndex, values: list[str], max_seq_len: int | None
                   ) -> tuple[int, ...]:
    if max_seq_len is not None:
        return tuple(sorted({s for s in (*BASE_PROBES, max_seq_len // 2 + 1, max_seq_len)
                             if 1 <= s <= max_seq_len}))
    window = 0
    for value in values:
        for node in idx.ancestors(value, through_shape=True, limit=300):
            for i in node.input:
                c = idx.const(i) if i else None
                if c is not None and c.size == 1 and np.issubdtype(c.dtype, np.integer):
                    w = abs(int(c.reshape(-1)[0]))
                    if 2 <= w < MAX_PROBE:
                        window = max(window, w)
    return tuple(sorted({*BASE_PROBES, min(MAX_PROBE, max(97, 2 * window + 3))}))


def _layer_mask(layer: int, block: AttentionBlock, evaluated: dict, probes: tuple[int, ...],
                causal_op: bool) -> LayerMask:
    where = f"layer {layer}"
    if not block.mask_inputs:
        plain = make_family("causal", {}, "model", None) if causal_op else _dense()
        return LayerMask(layer, plain, "family", "causal (Attention is_causal)" if causal_op
                         else "none", ())
    allowed = {}
    for s in probes:
        try:
            results = evaluated.get(s)
            if results is None:
                raise _ProbeFailed(f"cannot evaluate the mask the model computes at length {s}")
            allowed[s] = _allowed(block, results, s, where)
        except _ProbeFailed as err:
            if s == min(probes):
                raise ModelError(f"{where}: {err}", hint="report the model to stofc") from None
            continue  # the model itself does not run at this length (e.g. its positions)
        if causal_op:
            allowed[s] &= np.tri(s, dtype=bool)
    probes = tuple(sorted(allowed))
    top = max(probes)
    node, kind, text = _fit(allowed[top])
    for s in probes:
        if not np.array_equal(_dense_of(node, top)[:s, :s], allowed[s]):
            raise ModelError(f"{where}: the mask the model computes at length {s} is not the "
                             f"top-left corner of its mask at length {top} ({text})",
                             hint="stofc compiles one mask per layer for every length; "
                                  "report the model to stofc")
    return LayerMask(layer, node, kind, text, probes)


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


def _fit(allowed: np.ndarray) -> tuple[Node, str, str]:
    """(node, kind, description) reproducing ``allowed`` exactly at its length."""
    n = allowed.shape[0]
    if allowed.all():
        return _dense(), "family", "none (dense)"
    band = _band(allowed)
    if band is not None:
        lo, hi = band
        if lo == 0 and hi >= n - 1:
            return make_family("causal", {}, "model", None), "family", "causal"
        if lo == 0:
            return (make_family("sliding", {"window": hi}, "model", None, causal=True), "family",
                    f"sliding window {hi} (causal: 0 <= q-k <= {hi})")
        if lo == -hi:
            return (make_family("sliding", {"window": hi}, "model", None), "family",
                    f"sliding window {hi} (both sides: |q-k| <= {hi})")
    chunk = _chunk(allowed)
    if chunk is not None:
        size, causal = chunk
        nb = -(-n // size)
        layout = np.eye(nb, dtype=bool)
        node = Family("blocksparse", (("block", size), ("layout", _array(layout))),
                      causal=causal)
        return node, "blocksparse", f"chunked, chunks of {size}" + (" (causal)" if causal else "")
    return (Family("bitmap", (("file", _array(allowed)),)), "bitmap",
            f"bitmap {n}x{n} (density {allowed.mean():.3f}; no MASKS.md family fits)")


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


def _evaluate(idx: GraphIndex, graph: ModelGraph, values: list[str],
              s: int) -> dict[str, np.ndarray] | None:
    """Every mask value for batch 1, length ``s``, all-ones padding (ORT CPU)."""
    import onnxruntime as ort  # optional: ONNX Runtime

    nodes = {n.name: n for v in values for n in idx.ancestors(v, through_shape=True,
                                                               limit=1 << 20)}
    ordered = [n for n in idx.nodes if n.name in nodes]
    needed = {i for n in ordered for i in n.input if i}
    feeds, inputs = {}, []
    for vi in graph.model.graph.input:
        if vi.name not in needed or vi.name in idx.initializers:
            continue
        feed = _feed(vi, s)
        if feed is None:
            return None
        feeds[vi.name] = feed
        inputs.append(vi)
    inits = [t for t in graph.model.graph.initializer if t.name in needed]
    outs = [onnx.helper.make_tensor_value_info(v, idx.elem_type(v) or onnx.TensorProto.FLOAT,
                                               None) for v in values]
    sub = onnx.helper.make_graph(ordered, "stofc_mask_probe", inputs, outs, inits)
    model = onnx.helper.make_model(sub, opset_imports=list(graph.model.opset_import),
                                   ir_version=graph.model.ir_version)
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 4
        sess = ort.InferenceSession(model.SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            results = sess.run(values, feeds)
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
