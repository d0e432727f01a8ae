"""``build_plan``: frontend layers + mask -> a :class:`Plan` with analytical configs.

No GPU: the scheme comes from :func:`stofc.plan.moves.initial_scheme`, every
segment's kernel from the family's ``default_config`` for ``tokens = batch x
max_seq_len`` on the given :class:`~stofc.targets.GpuProfile`. The tuner
replaces schemes and configs later, through :func:`plan_layer` /
:func:`kernel_spec`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from stofc.errors import PlanError
from stofc.frontend.types import Layer
from stofc.kernels import gemm as gemm_family
from stofc.kernels import gemm_gemm as gemm_gemm_family
from stofc.kernels import norm as norm_family
from stofc.kernels.epilogue import Epilogue
from stofc.plan.dataflow import value_widths
from stofc.plan.families import SegmentMatch, match_segments
from stofc.plan.moves import initial_scheme
from stofc.plan.plan import KernelSpec, LayerPlan, Plan, Segment
from stofc.plan.scheme import FusionScheme
from stofc.targets import GpuProfile

DTYPES = ("float16", "bfloat16")
QKV_STORES = ("row", "heads")
NORM_ROW_TILE = 16  # rows per GEMM+norm block: fuse the norm once tokens fill one block per SM
# Analytical default for GEMM segments: the vendor path. Measured on an H200
# (bench/results/layer-gemm-sweep-h200-2026-11-22.json): cuBLAS ran the BERT-base
# GEMMs 1.3-1.7x faster than the best mma.sync template config at 128 tokens and
# 1.9-2.6x faster at 4096-32768 tokens, more than the epilogue pass it adds.
# The hand-written template stays a tuning candidate (and the only option for
# the head-split QKV store).
PREFER_VENDOR_GEMM = True  # row = [B, S, 3, H, D] packed; heads = [3, B, H, S, D]


def _attention_spec(layer: Layer, mask: Any, profile: GpuProfile, dtype: str,
                    max_seq_len: int, batch: int) -> KernelSpec:
    """The attention selector's choice (``stofc.kernels.attention.select_kernel``) when
    ``mask`` is an encoded :class:`~stofc.masks.format.MaskFormat`; otherwise a pending
    spec (the package step selects once the mask is encoded)."""
    from stofc.masks.format import MaskFormat

    if not isinstance(mask, MaskFormat):
        return KernelSpec("attention", "attention/select_kernel", (("selected", False),))
    from stofc.kernels.attention import select_kernel
    from stofc.kernels.attention.config import template_name

    block = layer.attention
    choice = select_kernel(mask, profile, batch=batch, heads=block.num_heads,
                           seq_len=max_seq_len, head_dim=block.head_dim)
    params = tuple(dataclasses.asdict(choice.config).items())
    return KernelSpec("attention", template_name(choice.kernel, choice.config.mma),
                      (("dtype", dtype), ("selected", True), *params,
                       ("explanation", choice.explanation)))


def kernel_spec(match: SegmentMatch, *, tokens: int, profile: GpuProfile, dtype: str,
                store: str = "row", vendor: bool = False) -> KernelSpec:
    """The default (analytical) kernel for one non-attention segment.

    ``vendor`` selects cuBLAS plus the fused memory-bound epilogue for ``gemm``
    and ``gemm_norm`` segments (the candidate every hand-written GEMM must beat).
    """
    ep = match.epilogues[-1] if match.epilogues else Epilogue()
    common: tuple[tuple[str, Any], ...] = (("dtype", dtype),)
    if match.family in ("gemm", "gemm_norm"):
        n, k = match.dim("n0"), match.dim("k0")
        if vendor:
            cfg = norm_family.default_config(norm_family.NormProblem(tokens, n, dtype, ep),
                                             profile)
            # lt: fold bias / ReLU / residual into cuBLASLt's epilogue where it can
            return KernelSpec(match.family, "vendor/cublas",
                              (*common, ("store", store), ("lt", True), *cfg.as_params()))
        problem = gemm_family.GemmProblem(tokens, n, k, dtype, ep, store)
        gcfg = gemm_family.default_config(problem, profile)
        return KernelSpec(match.family, gemm_family.TEMPLATE,
                          (*common, ("store", store), *gcfg.as_params()))
    if match.family == "gemm_gemm":
        problem2 = gemm_gemm_family.problem_of(match, tokens, dtype)
        cfg2 = gemm_gemm_family.default_config(problem2, profile)
        return KernelSpec(match.family, gemm_gemm_family.TEMPLATE, (*common, *cfg2.as_params()))
    if match.family == "ort":
        return KernelSpec("ort", "onnxruntime", (("reason", "no template implements it"),))
    if match.family == "add_norm":
        width = _row_width(match)
        ncfg = norm_family.default_config(norm_family.NormProblem(tokens, width, dtype, ep),
                                          profile)
        return KernelSpec(match.family, norm_family.TEMPLATE,
                          (*common, ("n", width), *ncfg.as_params()))
    raise PlanError(f"no kernel family {match.family!r}", hint="this is a stofc bug; report it")


def _row_width(match: SegmentMatch) -> int:
    dims = dict(match.dims)
    if "n" in dims:
        return dims["n"]
    raise PlanError(f"segment {match.ordinal} has no known row width",
                    hint="the frontend must give bias/norm widths")


def plan_layer(layer: Layer, scheme: FusionScheme, *, tokens: int, profile: GpuProfile,
               dtype: str, mask: Any = None, max_seq_len: int = 0,
               qkv_store: str = "row", vendor: bool = False, batch: int = 1) -> LayerPlan:
    """Segments of ``scheme`` with default kernels (raises ``SchemeRejected``).

    ``vendor`` puts GEMM segments that store row-major on the vendor path
    (cuBLAS + fused epilogue); the hand-written template otherwise.
    """
    segments = []
    for match in match_segments(layer, scheme):
        match = _with_width(layer, match)
        if match.family == "attention":
            spec = _attention_spec(layer, mask, profile, dtype, max_seq_len, batch)
        else:
            store = qkv_store if set(match.roles) & {"qkv", "q", "k", "v"} else "row"
            spec = kernel_spec(match, tokens=tokens, profile=profile, dtype=dtype, store=store,
                               vendor=vendor and store == "row")
        segments.append(Segment(layer=layer.index, ordinal=match.ordinal, ops=match.ops,
                                family=match.family, epilogues=match.epilogues,
                                bindings=match.bindings, dims=match.dims, epsilon=match.epsilon,
                                roles=match.roles, inputs=match.inputs, outputs=match.outputs,
                                kernel=spec))
    return LayerPlan(layer.index, layer.norm_order, scheme, tuple(segments))


def _with_width(layer: Layer, match: SegmentMatch) -> SegmentMatch:
    """Add ``n`` (the row width, from the dataflow) to memory-bound segments' dims."""
    if match.family != "add_norm":
        return match
    width = value_widths(layer)[match.binding("out") or match.inputs[0]]
    return SegmentMatch(match.ordinal, match.ops, match.family, match.epilogues, match.bindings,
                        (*match.dims, ("n", int(width))), match.epsilon, match.roles,
                        match.inputs, match.outputs)


def _mask_id(mask: Any) -> str:
    if mask is None:
        return ""
    spec_hash = getattr(mask, "spec_hash", None)
    if isinstance(spec_hash, str):
        return spec_hash
    return hashlib.sha256(str(mask).encode()).hexdigest()


def _default_layer_plan(layer: Layer, tokens: int, profile: GpuProfile, dtype: str, mask: Any,
                        max_seq_len: int, qkv_store: str, batch: int) -> LayerPlan:
    """The rule-based scheme; without the FFN chain if no GEMM+GEMM config fits the GPU."""
    min_norm = NORM_ROW_TILE * profile.sm_count
    scheme = initial_scheme(layer, tokens=tokens, norm_fusion_min_tokens=min_norm)
    try:
        return plan_layer(layer, scheme, tokens=tokens, profile=profile, dtype=dtype, mask=mask,
                          max_seq_len=max_seq_len, qkv_store=qkv_store,
                          vendor=PREFER_VENDOR_GEMM, batch=batch)
    except PlanError:
        scheme = initial_scheme(layer, tokens=tokens, norm_fusion_min_tokens=min_norm,
                                ffn_chain_max_tokens=0)
        return plan_layer(layer, scheme, tokens=tokens, profile=profile, dtype=dtype, mask=mask,
                          max_seq_len=max_seq_len, qkv_store=qkv_store,
                          vendor=PREFER_VENDOR_GEMM, batch=batch)


def build_plan(model_graph: Any, mask_spec: Any, profile: GpuProfile, *, dtype: str,
               max_seq_len: int, batch: int = 1, qkv_store: str = "row") -> Plan:
    """The default plan for every layer of ``model_graph`` (a ``ModelGraph`` or layers).

    ``tokens = batch * max_seq_len`` steers the initial scheme and configs.
    Raises :class:`PlanError` for an unsupported dtype or layout.
    """
    if dtype not in DTYPES:
        raise PlanError(f"dtype {dtype!r} is not supported", hint=f"use one of {DTYPES}")
    if qkv_store not in QKV_STORES:
        raise PlanError(f"QKV layout {qkv_store!r} is not supported",
                        hint=f"use one of {QKV_STORES}")
    if max_seq_len <= 0 or batch <= 0:
        raise PlanError(f"max_seq_len={max_seq_len}, batch={batch} must be positive",
                        hint="pass --seq-len and --batch as positive integers")
    layers = getattr(model_graph, "layers", model_graph)
    tokens = batch * max_seq_len
    plans = []
    for layer in layers:
        plans.append(_default_layer_plan(layer, tokens, profile, dtype, mask_spec, max_seq_len,
                                         qkv_store, batch))
    return Plan(gpu=profile.name, arch=profile.arch, dtype=dtype, max_seq_len=max_seq_len,
                tokens=tokens, mask=_mask_id(mask_spec), layers=tuple(plans))
