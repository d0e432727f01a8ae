"""Whether stofc runs a block's rotary position embedding (RoPE), checked exactly.

:mod:`stofc.frontend.rotary` finds RoPE-shaped dataflow on Q and K (a candidate: form,
rotated width, the cos / sin operands). This module decides whether the package replaces
it by one ``ai.stofc`` ``Rotary`` node (``cuda/ort/OPS.md``) reading the Q, K and V
projection results and writing the packed ``[Q' | K' | V]`` SparseAttention reads, and
returns the block with its :class:`~stofc.frontend.types.RopeFusion`, or with the one-line
reason it does not (``rope_refusal``; the rotation then stays with ONNX Runtime as the
model has it). Never a silent miscompile:

1. **Tables.** The op reads the model's own cos / sin: for the decomposed forms
   (``x * cos + rotate(x) * sin``) the Muls' operands with the head axis removed (the
   ``Unsqueeze`` that added it is skipped), which must be ``[S, W]`` or ``[1 | B, S, W]``
   against the rotated value's layout (no per-head tables, a position axis); for ONNX
   Runtime's ``com.microsoft`` ``RotaryEmbedding`` (and ONNX's opset-23 op) its caches and
   position ids. Q and K must read the same tables.
2. **Sources.** Behind each rotated value the walk passes views (Reshape, Transpose,
   (Un)squeeze, Split / Slice / Gather of a packed projection) to the projection result:
   one ``[B, S, (H + 2 Hkv) D]`` value shared by Q, K and V (ModernBERT's ``Wqkv``, Phi-3's
   ``qkv_proj``), else each role's ``[B, S, heads D]``, else the rotated value itself (a
   per-head norm before the rotation, Gemma 3).
3. **Probe.** For Q, K and V the model's own nodes from the sources (and the tables) to the
   value the attention reads are cut out and run on integer-valued probes by ONNX Runtime
   (:mod:`stofc.frontend.probe`); the result must equal, element for element, the op's
   function (:func:`stofc.kernels.rotary.rotary_reference`) laid out as the attention reads
   it. Integer probes make every product and sum exact in float32, float16 and bfloat16, so
   any other permutation, sign, slice bound, table column or head order is caught.

The nodes those cuts cover (and the table ``Unsqueeze`` nodes only they read) are what the
op replaces.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from stofc.frontend.graph import GraphIndex
from stofc.frontend.probe import ProbeError, cut, evaluate
from stofc.frontend.types import AttentionBlock, RopeFusion, RopeSource, Rotary
from stofc.kernels.reference import rope
from stofc.kernels.rotary import table_rows

_VIEWS = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Split", "Slice", "Gather", "Identity")
B, S = 3, 5        # probe batch and length (distinct from each other and from 1)
_CACHE_ROWS = 16   # rows of a probe cos/sin cache whose length is not static


class _Refuse(Exception):
    """RoPE stays with ONNX Runtime; carries the reason."""


@dataclass(frozen=True)
class _Tables:
    """One rotated value's tables: the values the probe feeds (the model's operands), what
    the op reads, and the layout labels of the fed cos operand."""

    cos: str
    sin: str
    op_cos: str
    op_sin: str
    squeeze: int | None
    labels: tuple[str, ...]
    position_ids: str | None
    nodes: tuple[str, ...]   # Unsqueeze nodes between the op's tables and the operands


def fuse_rope(idx: GraphIndex, block: AttentionBlock) -> AttentionBlock:
    """``block`` with its RoPE fusion decided (module doc): ``rope_fusion`` set, or
    ``rope_refusal`` saying why not. A block without RoPE is returned as it is."""
    if not block.rope:
        return block
    try:
        fusion = _fusion(idx, block)
    except (_Refuse, ProbeError) as why:
        return replace(block, rope_fusion=None, rope_refusal=str(why))
    return replace(block, rope_fusion=fusion, rope_refusal="")


def _fusion(idx: GraphIndex, block: AttentionBlock) -> RopeFusion:
    q_rot = next((r for r in block.rope if r.output == block.q_input), None)
    k_rot = next((r for r in block.rope if r.output == block.k_input), None)
    if q_rot is None or k_rot is None:
        raise _Refuse(f"only {'Q' if k_rot is None else 'K'} is rotated: Rotary rotates both")
    if (q_rot.form, q_rot.tables == "contrib") != (k_rot.form, k_rot.tables == "contrib"):
        raise _Refuse("Q and K are rotated in different forms")
    tq, tk = _tables(idx, q_rot, block.q_layout), _tables(idx, k_rot, block.k_layout)
    if (tq.op_cos, tq.op_sin, tq.squeeze, tq.position_ids) != \
            (tk.op_cos, tk.op_sin, tk.squeeze, tk.position_ids):
        raise _Refuse("Q and K read different cos/sin tables")
    width = _width(idx, tq.cos)
    rd = _rotary_dim(idx, block, q_rot, width)
    sources = _sources(idx, block, q_rot, k_rot)
    probe = _Probe(idx, block, sources, q_rot.form == "interleaved", rd)
    nodes = [*probe.check("q", block.q_input, block.q_layout, tq),
             *probe.check("k", block.k_input, block.k_layout, tk),
             *probe.check("v", block.v_input, block.v_layout, None)]
    covered = set(nodes) | set(block.nodes)
    for name in (*tq.nodes, *tk.nodes):
        out = idx.by_name[name].output[0]
        if all(u.name in covered for u in idx.users(out)) and not idx.is_graph_output(out):
            nodes.append(name)
    return RopeFusion(form=q_rot.form, rotary_dim=rd, tables=q_rot.tables, cos=tq.op_cos,
                      sin=tq.op_sin, sources=sources, nodes=idx.in_order(nodes),
                      squeeze=tq.squeeze, position_ids=tq.position_ids)


def _width(idx: GraphIndex, table: str) -> int:
    shape = idx.shape(table)
    if not shape or not isinstance(shape[-1], int):
        raise _Refuse(f"the width of the cos/sin table {table} is not static")
    return shape[-1]


def _rotary_dim(idx: GraphIndex, block: AttentionBlock, rot: Rotary, width: int) -> int:
    """The rotated width: the candidate's, which full tables (or twice half ones) give."""
    if rot.tables == "contrib":
        node = idx.by_name[rot.nodes[0]]
        rd = int(idx.attr(node, "rotary_embedding_dim", 0)) or block.head_dim
        if 2 * width != rd:
            raise _Refuse(f"the RotaryEmbedding caches have {width} columns for rotary_dim {rd}")
    else:
        rd = rot.rotary_dim or 0
        if width != rd:
            raise _Refuse(f"the cos/sin tables have {width} columns but {rd} dimensions are "
                          "rotated")
    if rd <= 0 or rd % 2 or rd > block.head_dim:
        raise _Refuse(f"rotary_dim {rd} is not even and within head_dim {block.head_dim}")
    return rd


def _tables(idx: GraphIndex, rot: Rotary, layout: str) -> _Tables:
    """The tables of one rotated value (module doc, step 1)."""
    if rot.tables == "contrib":
        node = idx.by_name[rot.nodes[0]]
        if node.domain == "com.microsoft":
            if float(idx.attr(node, "scale", 1.0)) != 1.0 or idx.attr(node, "is_packed_batching", 0):
                raise _Refuse("RotaryEmbedding with scale != 1 or packed batching")
            pos, cos, sin = node.input[1], node.input[2], node.input[3]
        else:   # ONNX's RotaryEmbedding (opset 23): X, cos_cache, sin_cache, position_ids?
            cos, sin = node.input[1], node.input[2]
            pos = node.input[3] if len(node.input) > 3 and node.input[3] else None
        return _Tables(cos, sin, cos, sin, None, (), pos or None, ())
    if rot.cos is None or rot.sin is None:
        raise _Refuse("the cos/sin operands were not found")
    if layout not in ("bhsd", "bshd"):
        raise _Refuse(f"RoPE on a {layout} value (not a per-head [B, H, S, D] or [B, S, H, D])")
    ops, bases = [], []
    for operand in (rot.cos, rot.sin):
        shape = idx.shape(operand)
        if shape is None or not 2 <= len(shape) <= 4:
            raise _Refuse(f"the cos/sin operand {operand} has no rank-2..4 shape")
        labels = tuple(layout[4 - len(shape):])
        for label, dim in zip(labels, shape, strict=True):
            if label == "h" and dim != 1:
                raise _Refuse(f"the cos/sin operand {operand} {list(shape)} differs per head")
            if label == "s" and dim == 1:
                raise _Refuse(f"the cos/sin operand {operand} {list(shape)} has no position axis")
        if tuple(a for a in labels if a != "h") not in (("s", "d"), ("b", "s", "d")):
            raise _Refuse(f"the cos/sin operand {operand} {list(shape)} is not [.., S, W]")
        ops.append(labels)
        bases.append(_without_head(idx, operand, labels))
    (cos, squeeze, nodes), (sin, squeeze_s, nodes_s) = bases
    if squeeze != squeeze_s or ops[0] != ops[1]:
        raise _Refuse("the cos and sin operands have different shapes")
    return _Tables(rot.cos, rot.sin, cos, sin, squeeze, ops[0], None, (*nodes, *nodes_s))


def _without_head(idx: GraphIndex, operand: str, labels: tuple[str, ...]
                  ) -> tuple[str, int | None, tuple[str, ...]]:
    """(the table the op reads, the axis the package squeezes from it or None, the
    Unsqueeze skipped): the operand without its head axis of size 1."""
    if "h" not in labels:
        return operand, None, ()
    axis = labels.index("h")
    node = idx.produced_by(operand, "Unsqueeze")
    if node is not None:
        axes = idx.const(node.input[1]) if len(node.input) > 1 else None
        axes = np.asarray(axes if axes is not None else idx.attr(node, "axes", [])).reshape(-1)
        if [int(a) % len(labels) for a in axes] == [axis]:
            return node.input[0], None, (node.name,)
    return operand, axis, ()


def _back(idx: GraphIndex, value: str) -> str | None:
    """The furthest rank-3 value behind ``value`` through views (None: none is)."""
    best = value if idx.rank(value) == 3 else None
    node = idx.producer.get(value)
    for _ in range(16):
        if node is None or node.op_type not in _VIEWS:
            break
        value = node.input[0]
        if idx.rank(value) == 3:
            best = value
        node = idx.producer.get(value)
    return best


def _sources(idx: GraphIndex, block: AttentionBlock, q_rot: Rotary, k_rot: Rotary
             ) -> tuple[RopeSource, ...]:
    """What the op reads (module doc, step 2)."""
    h, hkv, d = block.num_heads, block.kv_heads, block.head_dim
    values = ((q_rot.input, block.q_layout, h), (k_rot.input, block.k_layout, hkv),
              (block.v_input, block.v_layout, hkv))
    backs = [_back(idx, v) for v, _, _ in values]
    if len(set(backs)) == 1 and backs[0] is not None and \
            _last(idx, backs[0]) == (h + 2 * hkv) * d:
        return (RopeSource(backs[0], "packed"),)
    out = []
    for (value, layout, heads), back in zip(values, backs, strict=True):
        if back is not None and _last(idx, back) == heads * d:
            out.append(RopeSource(back, "bsf"))
        elif layout in ("bhsd", "bshd") or (layout == "bsf" and _last(idx, value) == heads * d):
            out.append(RopeSource(value, layout))
        else:
            raise _Refuse(f"cannot tell how {value} holds its heads")
    return tuple(out)


def _last(idx: GraphIndex, value: str) -> int | None:
    shape = idx.shape(value)
    return shape[-1] if shape and isinstance(shape[-1], int) else None


class _Probe:
    """Module doc, step 3: integer probes of the sources and tables, the cut of each role."""

    def __init__(self, idx: GraphIndex, block: AttentionBlock, sources: tuple[RopeSource, ...],
                 interleaved: bool, rotary_dim: int) -> None:
        self.idx, self.block, self.sources = idx, block, sources
        self.interleaved, self.rd = interleaved, rotary_dim
        self.rng = np.random.default_rng(20261126)
        self.values: dict[str, np.ndarray] = {}
        self.symbols: dict[str, int] = {}
        h, hkv, d = block.num_heads, block.kv_heads, block.head_dim
        for i, src in enumerate(sources):
            heads = (h, hkv, hkv)[i]
            dims = {"packed": (B, S, (h + 2 * hkv) * d), "bsf": (B, S, heads * d),
                    "bshd": (B, S, heads, d), "bhsd": (B, heads, S, d)}[src.layout]
            static = idx.shape(src.value) or ()
            if len(static) != len(dims) or any(isinstance(a, int) and a != b
                                               for a, b in zip(static, dims, strict=True)):
                raise _Refuse(f"{src.value} {list(static)} is not the {src.layout} value of "
                              f"{heads} heads of {d} the attention reads")
            self.values[src.value] = self._ints(dims, 8)
            self._name_symbols(src.value, "bs" if src.layout in ("packed", "bsf") else
                               src.layout)

    def _ints(self, shape: tuple[int, ...], bound: int) -> np.ndarray:
        return self.rng.integers(-bound, bound + 1, shape).astype(np.float64)

    def _name_symbols(self, value: str, labels: str) -> None:
        for label, dim in zip(labels, self.idx.shape(value) or (), strict=False):
            if isinstance(dim, str) and label in "bs":
                self.symbols.setdefault(dim, B if label == "b" else S)

    def _role(self, role: str) -> tuple[np.ndarray, int]:
        """The probe of one role's heads as [B, S, heads, D], and its head count."""
        b, d = self.block, self.block.head_dim
        heads = b.num_heads if role == "q" else b.kv_heads
        if len(self.sources) == 1:
            at = {"q": 0, "k": b.num_heads * d, "v": (b.num_heads + b.kv_heads) * d}[role]
            x = self.values[self.sources[0].value][..., at:at + heads * d]
            return x.reshape(B, S, heads, d), heads
        src = self.sources["qkv".index(role)]
        x = self.values[src.value]
        if src.layout == "bhsd":
            return x.transpose(0, 2, 1, 3), heads
        return x.reshape(B, S, heads, d), heads

    def _tables(self, t: _Tables) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray,
                                           np.ndarray | None]:
        """Probe feeds of the tables (and position ids) and the [B, S, W] rows they give."""
        idx = self.idx
        shape = idx.shape(t.cos) or ()
        width = shape[-1] if shape and isinstance(shape[-1], int) else self.rd
        feeds: dict[str, np.ndarray] = {}
        pos = None
        if t.position_ids is None:
            dims = tuple(1 if dim == 1 else {"b": B, "s": S, "d": width, "h": 1}[label]
                         for label, dim in zip(t.labels, shape, strict=True))
            for name in (t.cos, t.sin):
                feeds[name] = self._ints(dims, 4)
                self._name_symbols(name, "".join(t.labels))
            cos, sin = (feeds[n].squeeze(t.labels.index("h")) if "h" in t.labels else feeds[n]
                        for n in (t.cos, t.sin))
        else:
            rows = shape[0] if shape and isinstance(shape[0], int) else _CACHE_ROWS
            cos, sin = (self._ints((rows, width), 4) for _ in range(2))
            feeds |= {t.cos: cos, t.sin: sin}
            pshape = idx.shape(t.position_ids) or ()
            if len(pshape) == 1:
                pos = np.array([self.rng.integers(0, rows - S + 1)], np.int64)
            else:
                pos = self.rng.integers(0, rows, (1 if pshape[0] == 1 else B, S)).astype(np.int64)
            feeds[t.position_ids] = pos
        return feeds, cos, sin, pos

    def check(self, role: str, target: str, layout: str, tables: _Tables | None
              ) -> tuple[str, ...]:
        """The cut from the sources to ``target`` (the attention's input), after checking
        that the model computes there exactly what the op's output holds for ``role``."""
        idx = self.idx
        feeds = dict(self.values)
        x, heads = self._role(role)
        if tables is not None:
            extra, cos, sin, pos = self._tables(tables)
            feeds |= extra
            c = table_rows(cos, B, S, pos)[:, :, None, :]
            s = table_rows(sin, B, S, pos)[:, :, None, :]
            x = rope(x, c, s, self.rd, self.interleaved)
        want = {"bsf": x.reshape(B, S, heads * x.shape[-1]), "bshd": x,
                "bhsd": x.transpose(0, 2, 1, 3)}[layout]
        if target in self.values:             # the attention reads the source itself
            if tables is not None or len(self.sources) == 1:
                raise _Refuse(f"the attention reads {role.upper()} as it is projected")
            return ()
        piece = cut(idx, target, set(feeds))
        got = evaluate(idx, piece, feeds, self.symbols)
        if got.shape != want.shape or not np.array_equal(got.astype(np.float64), want):
            what = "rotation" if tables is not None else "head split"
            raise _Refuse(f"the {what} of {role.upper()} is not what Rotary computes "
                          f"({'interleaved' if self.interleaved else 'rotate-half'}, "
                          f"rotary_dim {self.rd}, {heads} heads: a probe of the model's "
                          "subgraph differs)")
        return tuple(n.name for n in piece.nodes)


__all__ = ["fuse_rope"]
