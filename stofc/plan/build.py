"""``build_plan``: frontend layers + encoded masks -> a :class:`Plan` with every kernel chosen.

No GPU: the scheme comes from :func:`stofc.plan.moves.initial_scheme`, every
segment's kernel from the kernel families (:mod:`stofc.kernels.catalog`): the
first applicable family's analytical default for ``tokens = batch x max_seq_len``
on the given :class:`~stofc.targets.GpuProfile` (the vendor path for row-major
GEMMs, by measurement: :mod:`stofc.kernels.vendor_gemm`), and for attention the
selector's choice on the layer's mask format (the base kernel of
:func:`stofc.kernels.attention.choose_attention`: the one that serves every shape
its run-time variants do not). The tuner replaces schemes and configs later,
through :func:`plan_layer`.

A plan built without masks (``masks=None``: ``stofc inspect``, tests of the
downstream kernels) chooses no attention kernel: its attention segments carry
:data:`~stofc.kernels.attention.family.NO_ATTENTION_KERNEL`, which no family renders.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stofc.errors import PlanError
from stofc.frontend.types import Layer
from stofc.kernels import catalog
from stofc.kernels.registry import PlanContext
from stofc.masks.format import MaskFormat
from stofc.masks.layers import LayerMasks, as_layer_masks
from stofc.plan.attention import attention_reads
from stofc.plan.dataflow import value_widths
from stofc.plan.families import SegmentMatch, match_segments
from stofc.plan.moves import initial_scheme
from stofc.plan.plan import KernelSpec, LayerPlan, Plan, Segment
from stofc.plan.scheme import FusionScheme
from stofc.targets import GpuProfile

DTYPES = ("float16", "bfloat16")
QKV_STORES = ("row", "heads")   # row = [B, S, 3, H, D] packed; heads = [3, B, H, S, D]
NORM_ROW_TILE = 16  # rows per GEMM+norm block: fuse the norm once tokens fill one block per SM
PREFER_VENDOR_GEMM = True   # the vendor family's place first (stofc.kernels.vendor_gemm)
PROJECTION_ROLES = frozenset({"qkv", "q", "k", "v"})


def segment_context(layer: Layer, match: Any, profile: GpuProfile, *, tokens: int, dtype: str,
                    fmt: MaskFormat | None = None, batch: int = 1, seq_len: int = 0,
                    qkv_store: str = "row") -> PlanContext:
    """What the families read of a layer besides the segment to state its problem: the
    store of a Q/K/V projection, and for attention the block, its mask format and inputs."""
    key_padding, bias = attention_reads(layer.attention)
    return PlanContext(tokens=tokens, dtype=dtype, profile=profile,
                       store=segment_store(match, qkv_store), qkv_store=qkv_store,
                       attention=layer.attention,
                       fmt=fmt, batch=batch, seq_len=seq_len, key_padding=key_padding, bias=bias)


def kernel_spec(match: SegmentMatch, *, tokens: int, profile: GpuProfile, dtype: str,
                store: str = "row", vendor: bool = False) -> KernelSpec:
    """The default (analytical) kernel for one non-attention segment.

    ``vendor`` lets vendor families (cuBLAS plus the fused memory-bound epilogue for
    ``gemm`` and ``gemm_norm`` segments) take their place first; otherwise only the
    hand-written templates are considered.
    """
    ctx = PlanContext(tokens=tokens, dtype=dtype, profile=profile, store=store)
    return catalog.default_kernel(match, ctx, vendor=vendor)


def segment_store(match: Any, qkv_store: str) -> str:
    """The output layout a segment is planned with: ``qkv_store`` for Q/K/V projections."""
    return qkv_store if set(match.roles) & PROJECTION_ROLES else "row"


def with_width(layer: Layer, match: SegmentMatch) -> SegmentMatch:
    """Add ``n`` (the row width, from the dataflow) to a memory-bound segment's dims: one
    that writes an ``out`` value and has no GEMM to give its widths."""
    dims = dict(match.dims)
    if "k0" in dims or "n" in dims or match.binding("out") is None:
        return match
    width = value_widths(layer)[match.binding("out") or match.inputs[0]]
    return SegmentMatch(match.ordinal, match.ops, match.family, match.epilogues, match.bindings,
                        (*match.dims, ("n", int(width))), match.epsilon, match.roles,
                        match.inputs, match.outputs)


def plan_layer(layer: Layer, scheme: FusionScheme, *, tokens: int, profile: GpuProfile,
               dtype: str, fmt: MaskFormat | None = None, max_seq_len: int = 0,
               qkv_store: str = "row", vendor: bool = False, batch: int = 1) -> LayerPlan:
    """Segments of ``scheme`` with default kernels (raises ``SchemeRejected``).

    ``fmt``: the layer's mask format, on which the attention kernel is chosen (without
    one the attention segment gets
    :data:`~stofc.kernels.attention.family.NO_ATTENTION_KERNEL`). ``vendor`` lets the
    vendor path take row-major GEMM segments (cuBLAS + fused epilogue); the
    hand-written template otherwise.
    """
    segments = []
    for match in match_segments(layer, scheme):
        match = with_width(layer, match)
        ctx = segment_context(layer, match, profile, tokens=tokens, dtype=dtype, fmt=fmt,
                              batch=batch, seq_len=max_seq_len, qkv_store=qkv_store)
        spec = catalog.default_kernel(match, ctx, vendor=vendor)
        segments.append(Segment(layer=layer.index, ordinal=match.ordinal, ops=match.ops,
                                family=match.family, epilogues=match.epilogues,
                                bindings=match.bindings, dims=match.dims, epsilon=match.epsilon,
                                roles=match.roles, inputs=match.inputs, outputs=match.outputs,
                                kernel=spec))
    return LayerPlan(layer.index, layer.norm_order, scheme, tuple(segments))


def default_scheme(layer: Layer, tokens: int, profile: GpuProfile, *,
                   ffn_chain: bool = True) -> FusionScheme:
    """The rule-based scheme for ``tokens`` on ``profile`` (``ffn_chain=False``: without the
    FFN chain on chip)."""
    min_norm = NORM_ROW_TILE * profile.sm_count
    if ffn_chain:
        return initial_scheme(layer, tokens=tokens, norm_fusion_min_tokens=min_norm)
    return initial_scheme(layer, tokens=tokens, norm_fusion_min_tokens=min_norm,
                          ffn_chain_max_tokens=0)


def _default_layer_plan(layer: Layer, tokens: int, profile: GpuProfile, dtype: str,
                        fmt: MaskFormat | None, max_seq_len: int, qkv_store: str,
                        batch: int) -> LayerPlan:
    """The rule-based scheme; without the FFN chain if no GEMM+GEMM config fits the GPU."""
    kwargs: dict[str, Any] = {"tokens": tokens, "profile": profile, "dtype": dtype, "fmt": fmt,
                              "max_seq_len": max_seq_len, "qkv_store": qkv_store,
                              "vendor": PREFER_VENDOR_GEMM, "batch": batch}
    try:
        return plan_layer(layer, default_scheme(layer, tokens, profile), **kwargs)
    except PlanError:
        return plan_layer(layer, default_scheme(layer, tokens, profile, ffn_chain=False),
                          **kwargs)


def build_plan(model_graph: Any, masks: LayerMasks | MaskFormat | Mapping[int, MaskFormat] | None,
               profile: GpuProfile, *, dtype: str, max_seq_len: int, batch: int = 1,
               qkv_store: str = "row") -> Plan:
    """The default plan for every layer of ``model_graph`` (a ``ModelGraph`` or layers).

    ``masks``: the encoded masks (:func:`stofc.masks.layers.encode_layers`; one
    format for every layer, or a mapping layer -> format, also do); the attention
    kernels are chosen on them. ``tokens = batch * max_seq_len`` steers the initial
    scheme and configs. Raises :class:`PlanError` for an unsupported dtype or layout.
    """
    if dtype not in DTYPES:
        raise PlanError(f"dtype {dtype!r} is not supported", hint=f"use one of {DTYPES}")
    if qkv_store not in QKV_STORES:
        raise PlanError(f"QKV layout {qkv_store!r} is not supported",
                        hint=f"use one of {QKV_STORES}")
    if max_seq_len <= 0 or batch <= 0:
        raise PlanError(f"max_seq_len={max_seq_len}, batch={batch} must be positive",
                        hint="pass --seq-len and --batch as positive integers")
    layers: Sequence[Layer] = getattr(model_graph, "layers", model_graph)
    layer_masks = as_layer_masks(masks, tuple(layer.index for layer in layers))
    tokens = batch * max_seq_len
    plans = [_default_layer_plan(layer, tokens, profile, dtype,
                                 None if layer_masks is None else layer_masks[layer.index],
                                 max_seq_len, qkv_store, batch)
             for layer in layers]
    return Plan(gpu=profile.name, arch=profile.arch, dtype=dtype, max_seq_len=max_seq_len,
                tokens=tokens, mask="" if layer_masks is None else layer_masks.plan_id,
                layers=tuple(plans))
