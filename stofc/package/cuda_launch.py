"""The CUDA launch attributes of a package's ai.stofc nodes (``cuda/ort/OPS.md``, kernel_abi 3).

The package writer's last pass over the rewritten model (:func:`annotate_cuda`).
The CUDA twins of ``libstofc_ort.so`` launch exactly what these attributes name:

* ``SparseAttention``: ``launch_plan`` names a ``*.plan.bin``
  (:func:`stofc.package.maskbin.attention_launch_data`: the walk list, gathered
  keys, residue permutation and tile-row orders that ``AttentionOp`` uploads; for a
  warp-specialised kernel the pair-row walk, work items, orders and combine table
  that ``WsLaunchData`` uploads), ``kernel_abi`` = :data:`KERNEL_ABI`;
  ``variant_launch_plans`` the same for each run-time variant. (``kernel``,
  ``block_threads``, ``blocks_per_tile_row``, ``smem_bytes``
  (:func:`attention_launch_numbers`) and the other ``variant_*`` attributes are the
  writer's.)
* ``FusedGemm``: cuBLASLt with the epilogue it can fold (bias; tanh-GELU without a
  residual; the residual as C when nothing follows it), then the stofc Add+Norm kernel for the rest
  (:func:`split_fused_gemm`, the C++ twin's ``split_fused_gemm``);
  ``epilogue_kernel`` ``FILE:ENTRY`` (``""`` when nothing is left),
  ``epilogue`` (its :class:`~stofc.kernels.epilogue.Epilogue` tag),
  ``epilogue_threads``, ``epilogue_rows``; and, when the tuner chose a cuBLASLt
  heuristic rank for the node's GEMM, ``lt_algo_m`` / ``lt_algo_rank``
  (:func:`lt_algo_attributes`).
* ``AddLayerNorm``: the same four attributes naming the Add+Norm kernel compiled
  for the node (residual, LayerNorm/RMSNorm, beta, the ``sum`` output; in a bf16
  package a float32 ``x`` and float32 gamma/beta, entry ``..._f32in_f32p_...``).
  A bf16 package's FusedGemm with a float32 bias writes float32 directly
  (cuBLASLt D in fp32, no epilogue kernel) and gets no ``lt_algo_*``: the
  tuner's rank was measured for a bf16 output. An
  RMSNorm with a shift has no CUDA kernel (the template shifts LayerNorm only):
  such a node gets no ``kernel_abi`` and fails on the CUDA EP with that reason.

The Add+Norm kernels take the segment's tuned ``tpr``/``rows`` when the segment
is a vendor (cuBLAS) or Add+Norm segment, else the family default; they are
rendered, compiled for the package's targets and written next to the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from stofc.codegen import Source
from stofc.kernels import norm as norm_family
from stofc.kernels.epilogue import Epilogue
from stofc.package.maskbin import attention_launch_data, write_attention_plan

KERNEL_ABI = 3          # cuda/ort/attention_abi.h kAttentionKernelAbi == cuda_attrs.h kCudaLaunchAbi
LT_DEFAULT, LT_BIAS, LT_GELU, LT_GELU_BIAS = 1, 4, 32, 36
TOKENS_HINT = 4096


@dataclass(frozen=True)
class GemmSplit:
    """What FusedGemm's CUDA twin does: the Lt epilogue, residual as C, the rest's Epilogue."""

    lt_epilogue: int
    lt_residual: bool
    rest: Epilogue


def split_fused_gemm(has_bias: bool, act: str, has_residual: bool,
                     residual_after_activation: bool = True) -> GemmSplit:
    """``SegmentRunner._compile_vendor``'s split with cuBLASLt for one FusedGemm node.

    ``lt_split``: ReLU never reaches FusedGemm, so Lt folds the bias; the residual
    joins as C (beta = 1) only when no activation is applied after it is added. Lt
    also applies ``gelu_tanh`` (its GELU epilogue is the tanh form) when no residual is
    involved: ``y = gelu_tanh(x@w + bias)`` comes out of cuBLASLt with no epilogue
    kernel. ``gelu_erf`` always stays with the epilogue kernel.
    """
    if act == "gelu_tanh" and not has_residual:
        return GemmSplit(LT_GELU_BIAS if has_bias else LT_GELU, False, Epilogue())
    lt_residual = has_residual and (act == "none" or not residual_after_activation)
    return GemmSplit(LT_BIAS if has_bias else LT_DEFAULT, lt_residual,
                     Epilogue(act=act, residual=has_residual and not lt_residual))


def norm_epilogue(*, has_residual: bool, rms: bool, has_beta: bool, has_sum: bool) -> Epilogue | None:
    """The Add+Norm Epilogue of an AddLayerNorm node; None when no kernel implements it."""
    if rms and has_beta:
        return None
    return Epilogue(residual=has_residual, norm="rmsnorm" if rms else "layernorm",
                    norm_shift=rms or has_beta, store_pre_norm=has_sum)


def _set(node: onnx.NodeProto, **attrs) -> None:
    keep = [a for a in node.attribute if a.name not in attrs]
    del node.attribute[:]
    node.attribute.extend(keep)
    node.attribute.extend(helper.make_attribute(k, v) for k, v in sorted(attrs.items()))


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _config(seg) -> norm_family.NormConfig | None:
    """The segment's tuned Add+Norm config (vendor and Add+Norm segments), else None."""
    spec = getattr(seg, "kernel", None)
    if spec is not None and (spec.template == "vendor/cublas" or seg.family == "add_norm") \
            and spec.param("tpr") and spec.param("rows"):
        return norm_family.NormConfig(int(spec.param("tpr")), int(spec.param("rows")))
    return None


def epilogue_source(ep: Epilogue, width: int, dtype: str,
                    config: norm_family.NormConfig | None = None, *, input_fp32: bool = False,
                    params_fp32: bool = False) -> tuple[Source, norm_family.NormConfig]:
    """The Add+Norm kernel source applying ``ep`` to rows of ``width`` (default config).

    ``input_fp32``: x is float32 (a bf16 package's pre-LN GEMM result);
    ``params_fp32``: gamma / beta are float32 (a bf16 package's LayerNorm).
    """
    problem = norm_family.NormProblem(TOKENS_HINT, width, dtype, ep, input_fp32=input_fp32,
                                      params_fp32=params_fp32)
    cfg = config or norm_family.default_config(problem, None)  # type: ignore[arg-type]
    return norm_family.render_norm(problem, cfg), cfg


def launch_attributes(source: Source, config: norm_family.NormConfig, ep: Epilogue,
                      kernel_path: str) -> dict:
    """The FusedGemm / AddLayerNorm CUDA attributes for an Add+Norm kernel at ``kernel_path``."""
    return {"kernel_abi": KERNEL_ABI, "epilogue_kernel": f"{kernel_path}:{source.entry_points[0]}",
            "epilogue": ep.tag, "epilogue_threads": config.tpr * config.rows,
            "epilogue_rows": config.rows}


def lt_algo_attributes(seg, width: int, contents) -> dict:
    """FusedGemm's ``lt_algo_m`` / ``lt_algo_rank`` (OPS.md) from the tuned vendor segments.

    The tuner records ``lt_algo`` (a cuBLASLt heuristic rank, valid for one M)
    with the M it was measured at (``lt_m``) on the segment's KernelSpec; the
    package's plan and every tuned bucket's plan contribute one (M, rank) pair when
    the node runs that segment's GEMM (same width: a packed Q|K|V node computes
    3N where the segment tuned N, and gets none). ``{}`` when nothing was tuned.
    """
    pairs: dict[int, int] = {}
    if seg is None:
        return {}
    for plan in (contents.plan, *(p for _, p in contents.buckets)):
        twin = next((s for lp in plan.layers if lp.index == seg.layer for s in lp.segments
                     if s.ordinal == seg.ordinal and s.ops == seg.ops), None)
        spec = getattr(twin, "kernel", None)
        if spec is None or spec.template != "vendor/cublas" or not spec.param("lt_algo"):
            continue
        if twin.dim("n0") != width or not spec.param("lt_m"):
            continue
        pairs.setdefault(int(spec.param("lt_m")), int(spec.param("lt_algo")))
    if not pairs:
        return {}
    ms = sorted(pairs)
    return {"lt_algo_m": ms, "lt_algo_rank": [pairs[m] for m in ms]}


def attention_launch_numbers(cfg, head_dim: int) -> tuple[int, int, int]:
    """SparseAttention's ``(block_threads, blocks_per_tile_row, smem_bytes)`` for ``cfg`` (OPS.md).

    Block-wise: ``q_split`` blocks per tile row and the dynamic shared memory; row-wise:
    ``tile / rows_per_block`` blocks per tile row, static shared memory only (0);
    warp-specialised: 384 threads, the dynamic shared memory, and 1 block per tile row
    (the attribute's fixed value for ws: its grid is ``H * B * items_upto[P]``, set by the
    plan's work items, not by tile rows).
    """
    from stofc.kernels.attention import smem_bytes

    if cfg.kind == "ws":
        per_row = 1
    else:
        per_row = cfg.q_split if cfg.kind == "block" else cfg.tile // cfg.rows_per_block
    smem = smem_bytes(cfg, head_dim) if cfg.kind in ("block", "ws") else 0
    return cfg.threads, per_row, smem


def attention_plan_name(mid: str, cfg) -> str:
    """The package path of ``cfg``'s ``*.plan.bin`` on mask ``mid``: one file per walk
    (block/row: kind, gather, permute; ws: its split, the only config field the walk uses)."""
    if cfg.kind == "ws":
        return f"masks/{mid}.ws{f'-split{cfg.split}' if cfg.split else ''}.plan.bin"
    return (f"masks/{mid}.{cfg.kind}{'-gather' if cfg.gather else ''}"
            f"{'-permute' if cfg.permute else ''}.plan.bin")


def _attention_plan(root: Path, fmt, cfg, mid: str) -> str:
    """The ``*.plan.bin`` of ``cfg`` on ``fmt`` (written once per walk)."""
    rel = attention_plan_name(mid, cfg)
    if not (root / rel).is_file():
        write_attention_plan(attention_launch_data(fmt, cfg), root / rel)
    return rel


def annotate_cuda(model: onnx.ModelProto, root: Path, contents, emitted) -> list[dict]:
    """Add the CUDA launch attributes to ``model``'s ai.stofc nodes; write plans and kernels.

    ``contents`` is the writer's PackageContents, ``emitted`` the rewrite's
    EmittedSegments. Returns plan.json ``kernels`` entries for the Add+Norm kernels
    it added (files under ``root/kernels``).
    """
    from stofc.package.kernels import compile_all
    from stofc.package.writer import kernel_file, mask_id, write_kernel

    dtype, arch = contents.plan.dtype, contents.targets[0]
    segs = {(s.layer, s.ordinal): s for lp in contents.plan.layers for s in lp.segments}
    seg_of = {name: segs.get((e.layer, e.ordinal)) for e in emitted for name in e.nodes}
    layer_of = {name: e.layer for e in emitted for name in e.nodes}
    widths = {t.name: list(t.dims) for t in model.graph.initializer}
    fp32_inits = {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    # bf16 packages (stofc.package.prenorm): a FusedGemm with a float32 bias writes float32
    fp32_values = {node.output[0] for node in model.graph.node
                   if node.domain == "ai.stofc" and node.op_type == "FusedGemm"
                   and len(node.input) > 2 and node.input[2] in fp32_inits}
    pending: list[tuple[onnx.NodeProto, Source, Epilogue, norm_family.NormConfig]] = []
    for node in model.graph.node:
        if node.domain != "ai.stofc":
            continue
        seg = seg_of.get(node.name)
        if node.op_type == "SparseAttention":
            layer = layer_of[node.name]
            ak, fmt = contents.attention[layer], contents.formats[layer]
            plans = [_attention_plan(root, fmt, c, mask_id(fmt))
                     for c in (ak.choice.config, *(v.choice.config for v in ak.variants))]
            extra = {"variant_launch_plans": ";".join(plans[1:])} if ak.variants else {}
            _set(node, launch_plan=plans[0], kernel_abi=KERNEL_ABI, **extra)
            continue
        inputs = list(node.input) + [""] * 4
        x_fp32 = params_fp32 = False
        if node.op_type == "FusedGemm":
            width = widths.get(inputs[1], [0, 0])[-1]
            split = split_fused_gemm(bool(inputs[2]), _text(_attr(node, "activation", "none")),
                                     bool(inputs[3]), bool(_attr(node, "residual_after_activation", 1)))
            ep: Epilogue | None = split.rest
        elif node.op_type == "AddLayerNorm":
            width = widths.get(inputs[2], [0])[-1]
            ep = norm_epilogue(has_residual=bool(inputs[1]), rms=bool(_attr(node, "rms", 0)),
                               has_beta=bool(inputs[3]),
                               has_sum=len(node.output) > 1 and bool(node.output[1]))
            x_fp32, params_fp32 = inputs[0] in fp32_values, inputs[2] in fp32_inits
        else:
            continue
        if node.op_type == "FusedGemm" and node.output[0] not in fp32_values:
            # (a float32-output GEMM keeps cuBLASLt's best: the tuned rank is for the bf16 D)
            _set(node, **lt_algo_attributes(seg, width, contents))
        if ep is None or not width:
            continue                      # no CUDA kernel: the twin says so at session creation
        if ep.is_identity:
            _set(node, kernel_abi=KERNEL_ABI, epilogue_kernel="")
            continue
        src, cfg_n = epilogue_source(ep, width, dtype, _config(seg), input_fp32=x_fp32,
                                     params_fp32=params_fp32)
        pending.append((node, src, ep, cfg_n))
    if not pending:
        return []
    sources = {src.name: src for _, src, _, _ in pending}
    fresh = [s for name, s in sources.items() if not (root / kernel_file(name, arch)).is_file()]
    compiled = compile_all(fresh, contents.targets) if fresh else {}
    entries = [{**write_kernel(root, src, compiled, contents.targets),
                "purpose": "CUDA twin epilogue (OPS.md)"} for src in fresh]
    for node, src, ep, cfg_n in pending:
        _set(node, **launch_attributes(src, cfg_n, ep, kernel_file(src.name, arch)))
    return entries
