"""The frontend's typed result: what later stages (plan, package) read.

Contract (stable names; fields may be added, never renamed):

* :class:`ModelGraph` is the result of :func:`stofc.frontend.load_model`.
* Each transformer layer is a :class:`Layer`: its :class:`AttentionBlock` and the
  ordered chain of :class:`ChainOp` that STOF fuses (15 operators for a BERT layer).
* A layer chain, post-LN (BERT)::

      gemm(qkv | q,k,v), bias_add, attention, gemm(out), bias_add, residual_add,
      layernorm, gemm(ffn_in), bias_add, gelu, gemm(ffn_out), bias_add,
      residual_add, layernorm

  pre-LN (GPT-2, ViT): ``layernorm`` first, no trailing norm (the next layer's
  leading norm, or the model's final norm, follows). T5: ``rmsnorm`` and no
  ``bias_add``. A gated FFN (SwiGLU, GeGLU: Llama, Gemma, Phi-3, ModernBERT) is
  ``gemm(ffn_in)`` with ``out_features = 2F``, ``bias_add?``, ``gated`` instead of
  ``gemm(ffn_in), bias_add, gelu``. Separate Q/K/V projections are three ``gemm`` ops (roles ``q``,
  ``k``, ``v``) each followed by its own ``bias_add`` when it has a bias; the
  order is q, bias q, k, bias k, v, bias v.
* **Gemm nodes with a C input**: an ONNX ``Gemm`` with a bias is represented as
  a ``gemm`` ChainOp followed by a ``bias_add`` ChainOp; both list the same
  ONNX node in ``nodes``. The intermediate value does not exist in the graph,
  so the ``gemm`` has ``inputs == (x,)``, ``outputs == ()`` and
  ``param("fused_bias") is True``; the ``bias_add`` has ``inputs == ()`` and
  ``outputs == (y,)`` (the Gemm's output, or the Reshape after it).
* ``inputs`` never lists weights, biases, norm scales or other constants (they
  are in ``params``); ``outputs`` lists values used outside the op.
* Shape arithmetic and Constant nodes used by one op only are included in its
  ``nodes`` (the rest of the shape plumbing is left to ONNX Runtime).
* Value names in ``inputs``/``outputs`` are ONNX value names of the
  canonicalized model (:attr:`ModelGraph.model`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import onnx


class OpKind(str, Enum):
    """The class of one operator in a layer's chain."""

    GEMM = "gemm"
    BIAS_ADD = "bias_add"
    ATTENTION = "attention"
    RESIDUAL_ADD = "residual_add"
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"
    GELU = "gelu"
    ACTIVATION = "activation"  # any other elementwise activation (Relu, ...): param "op"
    GATED = "gated"            # a gated FFN's act(gate) * up on a packed [gate | up] value


@dataclass(frozen=True)
class ChainOp:
    """One operator of a layer chain, with the ONNX nodes it covers.

    ``params`` keys by kind:

    * GEMM: ``in_features``, ``out_features`` (ints), ``weight`` (initializer
      name), ``weight_layout`` (``"KN"``: MatMul, y = x @ W; ``"NK"``: Gemm with
      transB=1), ``fused_bias`` (bool: a Gemm node that also adds the bias).
    * BIAS_ADD: ``bias`` (initializer name), ``features`` (int).
    * LAYERNORM: ``scale``, ``bias`` (initializer names; bias may be None),
      ``epsilon`` (float), ``form`` (``"op"`` | ``"decomposed"``).
    * RMSNORM: ``scale``, ``epsilon``, ``form`` (``"op"`` | ``"decomposed"``).
    * GELU: ``approximation`` (``"none"``: exact erf; ``"tanh"``), ``form``
      (``"op"`` | ``"erf"`` | ``"tanh"`` | ``"fastgelu"``).
    * ACTIVATION: ``op`` (ONNX op type, e.g. ``"Relu"``).
    * GATED: ``act`` (``"silu"``: SwiGLU; ``"gelu_erf"`` / ``"gelu_tanh"``: GeGLU;
      ``"relu"``: ReGLU), ``features`` (F). It reads one ``[..., 2F]`` value laid out
      ``[gate | up]`` on the last axis (the packed gate/up projection: one GEMM, see
      :mod:`stofc.frontend.pack_ffn`) and writes ``act(gate) * up``, ``[..., F]``: the
      activated half is always the first.
    * ATTENTION: ``layer`` (the index of its :class:`AttentionBlock`).
    """

    index: int
    kind: OpKind
    role: str
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple[tuple[str, Any], ...] = ()

    def param(self, name: str, default: Any = None) -> Any:
        """The value of parameter ``name``, or ``default`` when absent."""
        for key, value in self.params:
            if key == name:
                return value
        return default

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view (``inspect --json``)."""
        return {
            "index": self.index,
            "kind": self.kind.value,
            "role": self.role,
            "nodes": list(self.nodes),
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "params": {k: v for k, v in self.params},
        }


@dataclass(frozen=True)
class Rotary:
    """A rotary position embedding on Q or K (:mod:`stofc.frontend.rotary`).

    ``output`` is the post-RoPE value (the block's ``q_input`` / ``k_input``),
    ``input`` the pre-RoPE one; ``form``: ``"rotate_half"`` | ``"interleaved"``;
    ``rotary_dim``: the rotated part of the head dimension (partial rotary when
    smaller than head_dim); ``tables``: ``"cache"`` (cos/sin gathered from a constant),
    ``"computed"`` (Cos/Sin in the graph) or ``"contrib"`` (ORT's RotaryEmbedding op);
    ``nodes``: the RoPE arithmetic; ``cos`` / ``sin``: the Muls' table operands. What the
    structure suggests: :class:`RopeFusion` is the checked record stofc runs.
    """

    output: str
    input: str
    form: str
    rotary_dim: int | None
    tables: str
    nodes: tuple[str, ...]
    cos: str | None = None
    sin: str | None = None

    def describe(self) -> str:
        dim = f", {self.rotary_dim} dims" if self.rotary_dim else ""
        return f"{self.form}{dim}, cos/sin {self.tables}"


LAYOUTS = ("bsf", "bshd", "bhsd")  # [B, S, H*D] | [B, S, H, D] | [B, H, S, D]


@dataclass(frozen=True)
class RopeSource:
    """A value the ``Rotary`` op reads: ``layout`` is one of :data:`LAYOUTS` (one role's
    heads: Q's ``num_heads``, K's and V's ``kv_num_heads``) or ``"packed"`` (the
    ``[B, S, (H + 2 Hkv) D]`` projection laid out ``[Q | K | V]`` on its last axis)."""

    value: str
    layout: str


@dataclass(frozen=True)
class RopeFusion:
    """The RoPE of a block's Q and K as stofc runs it: one ``ai.stofc`` ``Rotary`` node
    (``cuda/ort/OPS.md``) in front of SparseAttention, in the layer's attention segment
    (:mod:`stofc.frontend.rope_fuse`).

    ``sources``: what the op reads, one packed value or the Q, K and V values (the
    projection results when they are views of them); Rotary writes ``[Q' | K' | V]`` with
    ``Q' = rope(Q)``, ``K' = rope(K)`` for each head (:func:`stofc.kernels.reference.rope`,
    ``form`` and ``rotary_dim``), which equals the block's ``q_input``, ``k_input`` and
    ``v_input`` laid out per their layouts: checked on a probe of the model's own
    subgraph when the frontend recognised it. ``cos`` / ``sin``: the tables as the model
    computes them, float or the model's float type, ``[S, W]`` or ``[1 | B, S, W]``
    (``squeeze``: the axis of size 1 to remove first, None when already so), or with
    ``position_ids`` a ``[P, W]`` cache; ``W`` is ``rotary_dim`` (full tables) or half of
    it. ``tables``: ``"computed"``, ``"cache"`` or ``"contrib"`` (where they come from, for
    ``inspect``). ``nodes``: the ONNX nodes the op replaces (head splits, the packed
    projection's split, the rotation), which leave the package.
    """

    form: str
    rotary_dim: int
    tables: str
    cos: str
    sin: str
    sources: tuple[RopeSource, ...]
    nodes: tuple[str, ...]
    squeeze: int | None = None
    position_ids: str | None = None

    @property
    def packed(self) -> bool:
        """Whether the op reads one packed ``[Q | K | V]`` value."""
        return len(self.sources) == 1

    def describe(self) -> str:
        src = "the packed Q|K|V projection" if self.packed else "Q, K, V"
        return (f"{self.form}, {self.rotary_dim} dims, cos/sin {self.tables}"
                f"{', position ids ' + self.position_ids if self.position_ids else ''}: "
                f"ai.stofc Rotary on {src}")


@dataclass(frozen=True)
class AttentionBlock:
    """One multi-head attention: from the head split of Q/K/V to the head merge.

    ``scale_form``: ``"div_scores"`` (scores / c), ``"mul_scores"`` (scores * c),
    ``"split_qk"`` (Q and K each multiplied by ``1/sqrt(sqrt(d))``),
    ``"scaled_q"`` (Q alone multiplied before QKᵀ), ``"onnx_attention"`` (the
    ONNX Attention op's own scale), ``"none"`` (scale 1: T5).
    ``mask_form``: ``"none"``, ``"additive"`` (scores + mask), ``"boolean_where"``
    (Where(bool, scores, -inf)), ``"relative_bias"`` (scores + a learned
    position bias, T5), ``"relative_bias+additive"`` (T5 with a padding mask),
    ``"boolean"`` (a boolean ``attn_mask`` of the ONNX Attention op), ``"bias"``
    (an additive term that is not a 0/-inf mask and not learned, e.g. ALiBi);
    several forms on one block are joined with ``+``. A mask that allows
    everything (exporters add one when there is no mask) counts as ``"none"``.
    ``scale`` is the factor that multiplies QKᵀ (1/sqrt(head_dim) usually).

    Values (checked against ONNX Runtime for every fixture by
    ``tests/unit/test_frontend_semantics.py``): ``q_input``/``k_input``/``v_input``
    are [B, S, H*D] (head h = columns h*D..h*D+D); with ``packed_qkv`` all three
    name one [B, S, 3*H*D] value laid out as q | k | v on the last axis.
    With ``kv_num_heads`` < ``num_heads`` (GQA/MQA) k and v hold ``kv_num_heads``
    heads (the values *before* an exported ``repeat_kv``), query head h reading K/V
    head ``h // (num_heads / kv_num_heads)``. ``q_layout``/``k_layout``/``v_layout``
    say how each input is laid out: ``"bsf"`` ([B, S, H*D], above), ``"bshd"`` or
    ``"bhsd"`` (4-D, e.g. the post-RoPE Q and K of Llama-style models); the package
    writer flattens 4-D inputs to [B, S, H*D] in front of SparseAttention.
    ``output`` is the merged [B, S, H*D] (or [B*S, H*D] when the exporter
    flattens before the output projection). ``mask_input``: the value on the
    scores, broadcastable to [B, H, S, S]: added when float, kept-where-True when
    bool; with several forms (``a+b``) it is the first one and ``mask_inputs``
    lists them all (their order does not matter), each with ``"add"`` (added) or
    ``"keep"`` (scores kept where True, -inf elsewhere). ``attention =
    softmax(scale * Q Kᵀ + masks) V`` per head.
    """

    layer: int
    num_heads: int
    head_dim: int
    hidden_size: int
    nodes: tuple[str, ...]
    q_input: str
    k_input: str
    v_input: str
    output: str
    packed_qkv: bool
    scale: float
    scale_form: str
    mask_form: str
    mask_source: str | None
    bias_input: str | None
    softmax_guarded: bool
    causal_in_graph: bool
    mask_input: str | None = None  # value added to / selecting the scores, when any
    rotary: bool = False  # Q/K come from a rotary position embedding (see rope_fusion)
    mask_inputs: tuple[tuple[str, str], ...] = ()  # every mask value: (name, "add" | "keep")
    kv_num_heads: int = 0          # K/V heads (GQA/MQA when < num_heads); 0 = num_heads
    q_layout: str = "bsf"          # layout of q_input/k_input/v_input (LAYOUTS)
    k_layout: str = "bsf"
    v_layout: str = "bsf"
    softcap: float = 0.0           # scores = softcap * tanh(scale q.k / softcap) (Gemma 2)
    rope: tuple[Rotary, ...] = ()  # the RoPE on Q and on K (when ``rotary``)
    kv_expanded: bool = False      # the export repeats K/V heads (repeat_kv); inputs are before it
    rope_fusion: RopeFusion | None = None   # RoPE run by stofc's Rotary op (the frontend's check)
    rope_refusal: str = ""         # why a RoPE is left to ONNX Runtime instead ("" when fused)

    @property
    def kv_heads(self) -> int:
        """K/V heads: ``kv_num_heads`` or, when 0, ``num_heads``."""
        return self.kv_num_heads or self.num_heads

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view (``inspect --json``'s ``attention`` entries)."""
        return {
            "layer": self.layer,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "nodes": list(self.nodes),
            "q_input": self.q_input,
            "k_input": self.k_input,
            "v_input": self.v_input,
            "output": self.output,
            "packed_qkv": self.packed_qkv,
            "scale": self.scale,
            "scale_form": self.scale_form,
            "mask_form": self.mask_form,
            "mask_source": self.mask_source,
            "mask_input": self.mask_input,
            "bias_input": self.bias_input,
            "softmax_guarded": self.softmax_guarded,
            "causal_in_graph": self.causal_in_graph,
            "rotary": self.rotary,
            "mask_inputs": [list(m) for m in self.mask_inputs],
            "kv_num_heads": self.kv_heads,
            "layouts": {"q": self.q_layout, "k": self.k_layout, "v": self.v_layout},
            "softcap": self.softcap,
            "rope": [{"output": r.output, "input": r.input, "form": r.form,
                      "rotary_dim": r.rotary_dim, "tables": r.tables} for r in self.rope],
            "kv_expanded": self.kv_expanded,
            "rope_fusion": None if self.rope_fusion is None else {
                "form": self.rope_fusion.form, "rotary_dim": self.rope_fusion.rotary_dim,
                "tables": self.rope_fusion.tables, "cos": self.rope_fusion.cos,
                "sin": self.rope_fusion.sin, "position_ids": self.rope_fusion.position_ids,
                "sources": [[s.value, s.layout] for s in self.rope_fusion.sources],
                "nodes": len(self.rope_fusion.nodes)},
            "rope_refusal": self.rope_refusal,
        }


@dataclass(frozen=True)
class Layer:
    """One transformer layer: its attention and its ordered operator chain."""

    index: int
    norm_order: str  # "post" | "pre"
    attention: AttentionBlock
    chain: tuple[ChainOp, ...]

    def ops(self, kind: OpKind) -> tuple[ChainOp, ...]:
        """The chain ops of one kind, in order."""
        return tuple(op for op in self.chain if op.kind == kind)


@dataclass(frozen=True)
class Unsupported:
    """A node stofc does not handle itself; ONNX Runtime runs it, for ``reason``."""

    node: str
    op_type: str
    reason: str


@dataclass(frozen=True)
class ValueInfo:
    """A graph input or output: name, element type and shape (ints or symbols)."""

    name: str
    dtype: str
    shape: tuple[int | str | None, ...]


@dataclass(frozen=True, eq=False)
class ModelGraph:
    """The understood model.

    ``left_to_ort``: names of every node not covered by any layer chain
    (embeddings, final norm, pooler, unsupported attention blocks ...), in graph
    order. ``unsupported``: the subset of nodes (or whole blocks) we recognised
    as attention-like but cannot handle, with the reason. ``model`` is the
    canonicalized ModelProto (shapes inferred, constant shape arithmetic folded)
    whose node and value names the rest refers to.
    """

    path: str
    opset: int
    inputs: tuple[ValueInfo, ...]
    outputs: tuple[ValueInfo, ...]
    layers: tuple[Layer, ...]
    unsupported: tuple[Unsupported, ...]
    left_to_ort: tuple[str, ...]
    padding_mask_input: str | None
    model: onnx.ModelProto = field(repr=False)

    @property
    def attention(self) -> tuple[AttentionBlock, ...]:
        """The attention blocks, one per layer, in layer order."""
        return tuple(layer.attention for layer in self.layers)
