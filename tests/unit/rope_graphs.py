"""Hand-built attention layers with RoPE for the frontend's recognition tests.

:func:`rope_layer` writes one layer, ``x -> Q, K, V projections -> head split -> RoPE on Q
and K -> softmax(Q K^T / sqrt(D)) V -> head merge -> output projection -> + x``, opset 17,
with the rotation spelled as exporters spell it (rotate-half: Slices, Neg, Concat;
interleaved (GPT-J): step-2 Slices, Unsqueeze, Concat, Reshape to the input's Shape;
partial rotary: the rotated part Concat-ed with the rest) and cos / sin computed in the
graph from the positions ``0..S-1`` (Range over the input's Shape), or ONNX Runtime's
``com.microsoft`` ``RotaryEmbedding`` on the flat projections with a constant cache and a
``position_ids`` input. Switches make it one of the forms stofc must refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

BIG = np.iinfo(np.int64).max


@dataclass(frozen=True)
class RopeCase:
    """What to build (defaults: Llama's rotate-half on every dimension, MHA)."""

    form: str = "rotate_half"     # or "interleaved"
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 32
    rotary_dim: int = 32
    contrib: bool = False         # com.microsoft RotaryEmbedding instead of the decomposed form
    contrib_scale: float = 1.0
    q_only: bool = False          # refused: K is not rotated
    per_head_tables: bool = False  # refused: cos/sin scaled per head
    k_tables_scaled: bool = False  # refused: K reads other tables than Q
    slice_off: int = 0            # refused when != 0: rotate-half's halves split off-centre
    base: float = 10000.0


class _G:
    """A tiny graph writer: fresh names, initializers."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def const(self, value, dtype=np.int64) -> str:
        self.count += 1
        name = f"c{self.count}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def op(self, op: str, *inputs: str, domain: str = "", **attrs) -> str:
        self.count += 1
        out = f"{op.lower()}{self.count}"
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=f"n{self.count}_{op}",
                                           domain=domain, **attrs))
        return out

    def slice(self, x: str, start: int, end: int, step: int = 1) -> str:
        return self.op("Slice", x, self.const([start]), self.const([end]), self.const([3]),
                       self.const([step]))

    def slice_shape(self, shape: str, start: int, end: int) -> str:
        return self.op("Slice", shape, self.const([start]), self.const([end]), self.const([0]))


def _rotate(g: _G, case: RopeCase, x: str, cos: str, sin: str) -> str:
    rd, d = case.rotary_dim, case.head_dim
    part = x if rd == d else g.slice(x, 0, rd)
    if case.form == "interleaved":
        x1, x2 = g.slice(part, 0, BIG, 2), g.slice(part, 1, BIG, 2)
        pairs = g.op("Concat", g.op("Unsqueeze", g.op("Neg", x2), g.const([-1])),
                     g.op("Unsqueeze", x1, g.const([-1])), axis=-1)
        rot = g.op("Reshape", pairs, g.op("Shape", part))
    else:
        half = rd // 2 + case.slice_off
        rot = g.op("Concat", g.op("Neg", g.slice(part, half, BIG)), g.slice(part, 0, half),
                   axis=-1)
    out = g.op("Add", g.op("Mul", part, cos), g.op("Mul", rot, sin))
    return out if rd == d else g.op("Concat", out, g.slice(x, rd, BIG), axis=-1)


def _tables(g: _G, case: RopeCase, x_in: str) -> tuple[str, str]:
    """cos, sin [1, 1, S, rotary_dim] from the positions 0..S-1 of ``x_in`` [B, S, *]."""
    rd = case.rotary_dim
    inv = 1.0 / case.base ** (np.arange(0, rd, 2, dtype=np.float64) / rd)
    seq = g.op("Gather", g.op("Shape", x_in), g.const(1), axis=0)
    pos = g.op("Cast", g.op("Range", g.const(0), seq, g.const(1)), to=TensorProto.FLOAT)
    freqs = g.op("Mul", g.op("Unsqueeze", pos, g.const([1])), g.const(inv, np.float32))
    if case.form == "interleaved":
        both = g.op("Concat", g.op("Unsqueeze", freqs, g.const([-1])),
                    g.op("Unsqueeze", freqs, g.const([-1])), axis=-1)
        emb = g.op("Reshape", both, g.const([0, rd]))
    else:
        emb = g.op("Concat", freqs, freqs, axis=-1)
    cos, sin = (g.op("Unsqueeze", g.op(f, emb), g.const([0, 1])) for f in ("Cos", "Sin"))
    if case.per_head_tables:
        scale = g.const(np.linspace(0.5, 1.0, case.heads).reshape(1, -1, 1, 1), np.float32)
        cos, sin = g.op("Mul", cos, scale), g.op("Mul", sin, scale)
    return cos, sin


def _heads(g: _G, flat: str, heads: int, d: int) -> str:
    return g.op("Transpose", g.op("Reshape", flat, g.const([0, 0, heads, d])), perm=[0, 2, 1, 3])


def rope_layer(case: RopeCase, path: Path, seed: int = 0) -> Path:
    """The layer of ``case`` saved at ``path`` (module doc)."""
    rng = np.random.default_rng(seed)
    h, hkv, d = case.heads, case.kv_heads, case.head_dim
    hid = h * d
    g = _G()
    w = {n: g.const(rng.standard_normal((hid, c)) / np.sqrt(hid), np.float32)
         for n, c in (("q", h * d), ("k", hkv * d), ("v", hkv * d), ("o", hid))}
    q3, k3, v3 = (g.op("MatMul", "x", w[n]) for n in "qkv")
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", hid])]
    if case.contrib:
        inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64,
                                                    ["B", "S"]))
        inv = 1.0 / case.base ** (np.arange(0, case.rotary_dim, 2) / case.rotary_dim)
        angles = np.arange(256)[:, None] * inv[None, :]
        cache = g.const(np.cos(angles), np.float32), g.const(np.sin(angles), np.float32)
        attrs = dict(interleaved=int(case.form == "interleaved"),
                     rotary_embedding_dim=case.rotary_dim if case.rotary_dim != d else 0)
        if case.contrib_scale != 1.0:
            attrs["scale"] = case.contrib_scale
        q3 = g.op("RotaryEmbedding", q3, "position_ids", *cache, domain="com.microsoft",
                  num_heads=h, **attrs)
        k3 = g.op("RotaryEmbedding", k3, "position_ids", *cache, domain="com.microsoft",
                  num_heads=hkv, **attrs)
        qh, kh = _heads(g, q3, h, d), _heads(g, k3, hkv, d)
    else:
        qh, kh = _heads(g, q3, h, d), _heads(g, k3, hkv, d)
        cos, sin = _tables(g, case, "x")
        qh = _rotate(g, case, qh, cos, sin)
        if not case.q_only:
            if case.k_tables_scaled:
                cos, sin = (g.op("Mul", t, g.const(0.5, np.float32)) for t in (cos, sin))
            kh = _rotate(g, case, kh, cos, sin)
    vh = _heads(g, v3, hkv, d)
    if hkv != h:   # repeat_kv: [B, Hkv, S, D] -> [B, Hkv, n, S, D] -> [B, H, S, D]
        def repeat(t: str) -> str:
            shp = g.op("Shape", t)
            dims = g.op("Concat", g.slice_shape(shp, 0, 2), g.const([h // hkv]),
                        g.slice_shape(shp, 2, 4), axis=0)
            big = g.op("Expand", g.op("Unsqueeze", t, g.const([2])), dims)
            return g.op("Reshape", big, g.const([0, h, -1, d]))
        kh, vh = repeat(kh), repeat(vh)
    scores = g.op("Mul", g.op("MatMul", qh, g.op("Transpose", kh, perm=[0, 1, 3, 2])),
                  g.const(d ** -0.5, np.float32))
    att = g.op("MatMul", g.op("Softmax", scores, axis=-1), vh)
    merged = g.op("Reshape", g.op("Transpose", att, perm=[0, 2, 1, 3]), g.const([0, 0, hid]))
    g.op("Add", g.op("MatMul", merged, w["o"]), "x")
    g.nodes[-1].output[0] = "y"   # the layer's output
    graph = helper.make_graph(g.nodes, "rope_layer", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                             ["B", "S", hid])], g.inits)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)]
                                              if case.contrib else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    onnx.save(model, str(path))
    return path
