"""What a SparseAttention node reads from the model: flat Q/K/V and the new attributes.

The frontend may stop Q/K/V at a 4-D value (the post-RoPE Q and K of Llama-style
models, ``[B, H, S, D]``; :attr:`~stofc.frontend.types.AttentionBlock.q_layout`).
SparseAttention reads ``[B, S, H*D]`` (``cuda/ort/OPS.md``), so :func:`flat_input`
puts a Transpose (``bhsd`` only) and a Reshape ``[0, 0, -1]`` in front, as standard
ONNX ops ONNX Runtime runs. This is the hook where a later wave fuses RoPE into the
QKV GEMM's epilogue or the attention kernel's Q/K load (the RoPE record is
``AttentionBlock.rope``): then the projection output goes to SparseAttention directly.

Attributes of the contract with the attention op: ``kv_num_heads`` (GQA/MQA: k and v
hold ``kv_num_heads`` heads; written only when fewer than ``num_heads``) and
``softcap`` (``softcap * tanh(scale * q.k / softcap)`` before mask and softmax; written
only when nonzero).
"""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from stofc.frontend.types import AttentionBlock

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
    ops = []
    for layout in (block.q_layout, block.k_layout, block.v_layout):
        if layout in _PERM:
            ops.append("onnx:Transpose")
        if layout != "bsf":
            ops.append("onnx:Reshape")
    return ops
