"""Initial fusion scheme (rules + recognised structures) and the stage-1 moves.

STOF's stage 1 starts from a rule-based scheme and changes one boundary at a
time: *expand* (a segment merges a neighbouring segment), *seize* (a segment
holding a compute-intensive op takes one operator from a neighbouring
memory-bound segment) and *compete* (two compute segments want the same
memory-bound segment; the one with a single compute op wins). Every move here
returns only executable schemes (:func:`stofc.plan.families.match_segments`
accepts them); the attention segment is never changed. The tuner drives these
and judges each by measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

from stofc.frontend.types import Layer, OpKind
from stofc.plan.families import MAX_NORM_WIDTH, SchemeRejected, match_segments
from stofc.plan.scheme import FusionScheme

# Recognised structure (STOF): fuse the FFN GEMM chain (GEMM+GEMM, intermediate
# on chip) when there are few tokens. Off by default: on an H200 the mma.sync
# GEMM+GEMM kernel (split over the hidden dimension) took 0.089 ms for the
# BERT-base layer at 128 tokens where cuBLAS + fused epilogues took 0.030 ms
# (bench/results/layer-h200-2026-11-22.md). The tuner still reaches it through
# expand moves; pass ffn_chain_max_tokens to initial_scheme to start from it.
FFN_CHAIN_MAX_TOKENS = 0


@dataclass(frozen=True)
class Move:
    """One stage-1 change: ``kind`` (expand|seize|compete, or split: the inverse,
    cutting ``segment`` before an operator), the segment it starts from, the side
    (``left``/``right``/``both``/``at``) and the resulting scheme."""

    kind: str
    segment: int
    side: str
    scheme: FusionScheme


def is_executable(layer: Layer, scheme: FusionScheme, *,
                  max_norm_width: int = MAX_NORM_WIDTH) -> bool:
    """True when every segment of ``scheme`` maps to a kernel family."""
    try:
        match_segments(layer, scheme, max_norm_width=max_norm_width)
    except SchemeRejected:
        return False
    return True


def _is_ci(layer: Layer, op: int) -> bool:
    return layer.chain[op].kind in (OpKind.GEMM, OpKind.ATTENTION)


def initial_scheme(layer: Layer, *, tokens: int, max_norm_width: int = MAX_NORM_WIDTH,
                   ffn_chain_max_tokens: int = FFN_CHAIN_MAX_TOKENS,
                   norm_fusion_min_tokens: int = 0) -> FusionScheme:
    """STOF's starting point for ``tokens`` = batch x length.

    Rules: attention alone; every GEMM starts a segment and absorbs the
    memory-bound operators after it while a family can still execute the
    segment (bias, activation, residual, and the norm when the row fits one
    tile and ``tokens >= norm_fusion_min_tokens``: a full-row tile has only
    ``tokens / 16`` blocks; a memory-bound segment, e.g. a sandwich norm's residual
    Add, always takes the norm: one pass instead of two); memory-bound operators
    before the first GEMM
    form their own segment. Recognised structure: the FFN chain (ffn_in ... ffn_out) becomes
    one GEMM+GEMM segment when ``tokens <= ffn_chain_max_tokens``.
    """
    n = len(layer.chain)
    starts: list[int] = [0]
    for op in range(1, n):
        prev_attention = layer.chain[op - 1].kind == OpKind.ATTENTION
        if _is_ci(layer, op) or prev_attention:
            starts.append(op)
            continue
        is_norm = layer.chain[op].kind in (OpKind.LAYERNORM, OpKind.RMSNORM)
        in_gemm = any(layer.chain[i].kind == OpKind.GEMM for i in range(starts[-1], op))
        if is_norm and in_gemm and tokens < norm_fusion_min_tokens:
            starts.append(op)
            continue
        trial = FusionScheme.unfused(n).with_boundaries([*starts, *range(op + 1, n)])
        seg = trial.segment_of(op)
        try:
            match_segments(layer, trial, max_norm_width=max_norm_width)
        except SchemeRejected as err:
            if err.segment == seg:
                starts.append(op)
    scheme = FusionScheme.unfused(n).with_boundaries(starts)
    if tokens <= ffn_chain_max_tokens:
        ffn_in = [i for i, o in enumerate(layer.chain) if o.kind == OpKind.GEMM
                  and o.role == "ffn_in"]
        if ffn_in:
            seg = scheme.segment_of(ffn_in[0])
            fused = merge(scheme, seg)
            candidates = []
            if fused is not None:
                tail = merge(fused, seg)  # also the norm after it (done in the fp32 pass)
                candidates = [c for c in (tail, fused) if c is not None]
            for cand in candidates:
                if is_executable(layer, cand, max_norm_width=max_norm_width):
                    scheme = cand
                    break
    return scheme


def merge(scheme: FusionScheme, segment: int) -> FusionScheme | None:
    """Merge ``segment`` with the next one (no validity check); None at the end."""
    if segment + 1 >= scheme.num_segments:
        return None
    codes = [c - (c > segment) for c in scheme.codes]
    return FusionScheme(tuple(codes))


def split(scheme: FusionScheme, op: int) -> FusionScheme:
    """Start a new segment at operator ``op`` (no validity check)."""
    return scheme.with_boundaries([*scheme.boundaries(), op])


def _attention_segments(layer: Layer, scheme: FusionScheme) -> set[int]:
    return {scheme.segment_of(i) for i, o in enumerate(layer.chain)
            if o.kind == OpKind.ATTENTION}


def _ci_count(layer: Layer, seg_ops: tuple[int, ...]) -> int:
    return sum(_is_ci(layer, i) for i in seg_ops)


def expand(layer: Layer, scheme: FusionScheme, segment: int, side: str, *,
           max_norm_width: int = MAX_NORM_WIDTH) -> FusionScheme | None:
    """``segment`` merges its whole ``side`` neighbour; None when not executable."""
    fixed = _attention_segments(layer, scheme)
    other = segment + (1 if side == "right" else -1)
    if other < 0 or other >= scheme.num_segments or {segment, other} & fixed:
        return None
    result = merge(scheme, min(segment, other))
    if result is None or not is_executable(layer, result, max_norm_width=max_norm_width):
        return None
    return result


def seize(layer: Layer, scheme: FusionScheme, segment: int, side: str, *,
          max_norm_width: int = MAX_NORM_WIDTH) -> FusionScheme | None:
    """A compute segment takes the nearest operator of a memory-bound ``side`` neighbour."""
    segs = scheme.segments()
    other = segment + (1 if side == "right" else -1)
    fixed = _attention_segments(layer, scheme)
    if (other < 0 or other >= len(segs) or {segment, other} & fixed
            or _ci_count(layer, segs[segment]) == 0 or _ci_count(layer, segs[other]) > 0
            or len(segs[other]) < 2):
        return None
    bounds = set(scheme.boundaries())
    if side == "right":
        bounds.discard(segs[other][0])
        bounds.add(segs[other][1])
    else:
        bounds.discard(segs[segment][0])
        bounds.add(segs[other][-1])
    result = scheme.with_boundaries(sorted(bounds))
    return result if is_executable(layer, result, max_norm_width=max_norm_width) else None


def compete(layer: Layer, scheme: FusionScheme, segment: int, *,
            max_norm_width: int = MAX_NORM_WIDTH) -> FusionScheme | None:
    """A memory-bound ``segment`` between two compute segments goes to one of them.

    The neighbour with a single compute op wins (it has room for the fusion);
    on a tie the left one (the producer) wins; if the winner cannot execute
    the result, the other one is tried.
    """
    segs = scheme.segments()
    if (segment <= 0 or segment >= len(segs) - 1 or _ci_count(layer, segs[segment]) > 0):
        return None
    left, right = segment - 1, segment + 1
    fixed = _attention_segments(layer, scheme)
    cl, cr = _ci_count(layer, segs[left]), _ci_count(layer, segs[right])
    if cl == 0 or cr == 0:
        return None
    order = [("left", left), ("right", right)]
    if cr == 1 and cl > 1:
        order.reverse()
    for _, winner in order:
        if winner in fixed:
            continue
        result = merge(scheme, min(winner, segment))
        if result is not None and is_executable(layer, result, max_norm_width=max_norm_width):
            return result
    return None


def neighbours(layer: Layer, scheme: FusionScheme, *,
               max_norm_width: int = MAX_NORM_WIDTH) -> list[Move]:
    """Every executable scheme one expand/seize/compete move away (deduplicated)."""
    seen: set[FusionScheme] = {scheme}
    moves: list[Move] = []
    for seg in range(scheme.num_segments):
        for side in ("left", "right"):
            for kind, fn in (("expand", expand), ("seize", seize)):
                result = fn(layer, scheme, seg, side, max_norm_width=max_norm_width)
                if result is not None and result not in seen:
                    seen.add(result)
                    moves.append(Move(kind, seg, side, result))
        result = compete(layer, scheme, seg, max_norm_width=max_norm_width)
        if result is not None and result not in seen:
            seen.add(result)
            moves.append(Move("compete", seg, "both", result))
    for op in range(1, len(scheme)):  # the inverse moves, so a greedy start can be undone
        if op in scheme.boundaries() or layer.chain[op].kind == OpKind.ATTENTION:
            continue
        result = split(scheme, op)
        if result not in seen and is_executable(layer, result, max_norm_width=max_norm_width):
            seen.add(result)
            moves.append(Move("split", scheme.segment_of(op), "at", result))
    return moves
