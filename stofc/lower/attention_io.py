"""What a SparseAttention node reads from the model: flat Q/K/V, RoPE, the new attributes.

The frontend may stop Q/K/V at a 4-D value (the post-RoPE Q and K of Llama-style
models, ``[B, H, S, D]``; :attr:`~stofc.frontend.types.AttentionBlock.q_layout`).
SparseAttention reads ``[B, S, H*D]`` (``cuda/ort/OPS.md``), so :func:`flat_input`
puts a Transpose (``bhsd`` only) and a Reshape ``[0, 0, -1]`` in front, as standard
ONNX ops ONNX Runtime runs.

A RoPE stofc runs (:attr:`~stofc.frontend.types.AttentionBlock.rope_fusion`) is one
``Rotary`` node in front of SparseAttention (:func:`rotary_input`): it reads the
projection results (one packed value, or Q, K, V flattened as above when the frontend
stopped at a 4-D value) and the model's cos / sin tables (as float32, the head axis
squeezed where the model had broadcast it), and writes the packed ``[Q' | K' | V]``
that SparseAttention reads with ``k`` and ``v`` omitted.

Attributes of the contract with the attention op: ``kv_num_heads`` (GQA/MQA: k and v
hold ``kv_num_heads`` heads; written only when fewer than ``num_heads``) and
``softcap`` (``softcap * tanh(scale * q.k / softcap)`` before mask and softmax; written
only when nonzero).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from stofc.frontend.types import AttentionBlock
from stofc.lower.emit import DOMAIN

_PERM = {"bhsd": [0, 2, 1, 3]}


def flat_input(em, value: str, layout: str) -> str:
    """``value`` as ``[B, S, H*D]`` in the package dtype (ONNX Transpose/Reshape first
    when it is 4-D)."""
    if layout == "bsf":
        return em.half(value)
    cur = value
    if layout in _PERM:
        out = em.name("attn_in_bshd")
        em.node("Transpose", [cur], [out], perm=_PERM[layout])
        cur = out
    shape = em.name("attn_in_shape")
    em.inits[shape] = numpy_helper.from_array(np.array([0, 0, -1], np.int64), shape)
    out = em.name("attn_in_flat")
    em.node("Reshape", [cur, shape], [out])
    return em.half(out)


def _table(em, value: str, squeeze: int | None) -> tuple[str, list[str]]:
    """A cos/sin table as Rotary reads it (float32, [S, W] or [1 | B, S, W]): one Cast and
    Squeeze per table value, shared by every layer reading it."""
    key = (value, squeeze)
    ops: list[str] = []
    if key not in em.tables:
        cur = value
        if em.idx.elem_type(value) != TensorProto.FLOAT:
            out = em.name("rope_table_f32")
            em.node("Cast", [cur], [out], to=TensorProto.FLOAT)
            cur, ops = out, ["onnx:Cast"]
        if squeeze is not None:
            axes, out = em.name("rope_squeeze_axes"), em.name("rope_table")
            em.inits[axes] = numpy_helper.from_array(np.array([squeeze], np.int64), axes)
            if em.opset >= 13:
                em.node("Squeeze", [cur, axes], [out])
            else:
                em.node("Squeeze", [cur], [out], axes=[squeeze])
            cur, ops = out, [*ops, "onnx:Squeeze"]
        em.tables[key] = cur
    return em.tables[key], ops


def rotary_input(em, block: AttentionBlock) -> tuple[str, list[str], str]:
    """The ``Rotary`` node of ``block``'s RoPE (module doc): its packed ``[Q' | K' | V]``
    output (SparseAttention's q), the ops emitted and a note."""
    fusion = block.rope_fusion
    assert fusion is not None
    ops: list[str] = []
    if fusion.packed:
        ins = [em.half(fusion.sources[0].value), "", ""]
    else:
        ins = [flat_input(em, s.value, s.layout) for s in fusion.sources]
        ops += [o for s in fusion.sources for o in _flat_ops(s.layout)]
    tables = []
    for value in (fusion.cos, fusion.sin):
        table, made = _table(em, value, fusion.squeeze)
        tables.append(table)
        ops += made
    ins += tables
    if fusion.position_ids:
        pos = fusion.position_ids
        if em.idx.elem_type(pos) != TensorProto.INT64:
            out = em.name("rope_position_ids")
            em.node("Cast", [pos], [out], to=TensorProto.INT64)
            pos, ops = out, [*ops, "onnx:Cast"]
        ins.append(pos)
    out = em.name("rotary_qkv")
    em.node("Rotary", ins, [out], domain=DOMAIN, stem="Rotary", num_heads=block.num_heads,
            kv_num_heads=block.kv_heads, head_dim=block.head_dim,
            rotary_dim=fusion.rotary_dim, interleaved=int(fusion.form == "interleaved"))
    ops.append("ai.stofc:Rotary")
    note = (f"RoPE ({fusion.describe()}) replaces {len(fusion.nodes)} ONNX nodes; "
            "SparseAttention reads its packed [Q' | K' | V]")
    return out, ops, note


def _flat_ops(layout: str) -> list[str]:
    return (["onnx:Transpose"] if layout in _PERM else []) + \
        (["onnx:Reshape"] if layout != "bsf" else [])


def attention_attributes(block: AttentionBlock) -> dict:
    """The optional SparseAttention attributes this block needs (module doc)."""
    attrs: dict = {}
    if block.kv_heads != block.num_heads:
        attrs["kv_num_heads"] = int(block.kv_heads)
    if block.softcap:
        attrs["softcap"] = float(block.softcap)
    return attrs


def reshaped_ops(block: AttentionBlock) -> list[str]:
    """The ONNX ops :func:`flat_input` adds for this block (for the segment record)."""
    return [o for layout in (block.q_layout, block.k_layout, block.v_layout)
            for o in _flat_ops(layout)]
