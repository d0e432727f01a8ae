"""STOF's rule-based starting segmentation of a layer chain (what ``stofc inspect`` shows).

A stand-in until the plan stage's own initial scheme is wired into ``inspect``:
it implements the classic-structure rule of the STOF paper and nothing more.

Segments (post-LN, BERT)::

    qkv:     gemm(q|k|v|qkv) + bias_add ...
    attention
    out:     gemm(out) + bias_add + residual_add + norm
    ffn_in:  gemm(ffn_in) + bias_add + gelu/activation
    ffn_out: gemm(ffn_out) + bias_add + residual_add + norm

Pre-LN (GPT-2, ViT, T5): a norm starts the next segment instead of closing the
previous one (``qkv`` = norm + projections, ``ffn_in`` = norm + gemm + bias +
activation; ``out`` and ``ffn_out`` end with the residual Add).

The scheme is also given in STOF's encoding: one number per chain operator,
operators of one segment share a value and a change of value is a boundary
(values alternate 0/1).
"""

from __future__ import annotations

from dataclasses import dataclass

from stofc.frontend.types import Layer, OpKind

_NORMS = (OpKind.LAYERNORM, OpKind.RMSNORM)
_STARTERS = {"q": "qkv", "qkv": "qkv", "out": "out", "ffn_in": "ffn_in", "ffn_out": "ffn_out"}


@dataclass(frozen=True)
class Segment:
    """A run of consecutive chain operators fused together."""

    name: str
    ops: tuple[int, ...]   # chain indices

    def as_dict(self) -> dict:
        return {"name": self.name, "ops": list(self.ops)}


def rule_based_segments(layer: Layer) -> tuple[Segment, ...]:
    """The starting segmentation of ``layer.chain`` (see the module docstring)."""
    segments: list[tuple[str, list[int]]] = []
    pending_norm: int | None = None  # pre-LN: a norm waiting for the gemm it leads
    for op in layer.chain:
        if op.kind == OpKind.ATTENTION:
            segments.append(("attention", [op.index]))
            continue
        if layer.norm_order == "pre" and op.kind in _NORMS:
            pending_norm = op.index
            continue
        if op.kind == OpKind.GEMM and op.role in _STARTERS:
            ops = [op.index] if pending_norm is None else [pending_norm, op.index]
            pending_norm = None
            segments.append((_STARTERS[op.role], ops))
            continue
        if pending_norm is not None:  # a pre-LN norm not followed by a gemm: alone
            segments.append(("norm", [pending_norm]))
            pending_norm = None
        if segments and segments[-1][0] != "attention":
            segments[-1][1].append(op.index)
        else:
            segments.append((op.kind.value, [op.index]))
    if pending_norm is not None:
        segments.append(("norm", [pending_norm]))
    return tuple(Segment(name, tuple(ops)) for name, ops in segments)


def encode_scheme(layer: Layer, segments: tuple[Segment, ...]) -> tuple[int, ...]:
    """STOF's per-operator encoding: segment values alternate 0/1 along the chain."""
    codes = [0] * len(layer.chain)
    for n, segment in enumerate(segments):
        for i in segment.ops:
            codes[i] = n % 2
    return tuple(codes)
