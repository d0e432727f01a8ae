"""The CUDA launch attributes of a package's ai.stofc nodes (``cuda/ort/OPS.md``, kernel_abi 3).

The lowering's last pass over the rewritten model (:func:`annotate_cuda`), before
anything is rendered: it chooses the CUDA twins' epilogue kernels and names every
file the twins load. The CUDA twins of ``libstofc_ort.so`` launch exactly what these
attributes name:

* ``SparseAttention``: ``launch_plan`` names a ``*.plan.bin``
  (:func:`stofc.kernels.attention.launch.launch_data`: the walk list, gathered
  keys, residue permutation and tile-row orders that ``AttentionOp`` uploads),
  ``kernel_abi`` = :data:`KERNEL_ABI`; ``variant_launch_plans`` the same for each
  run-time variant. (``kernel``, ``block_threads``, ``blocks_per_tile_row``,
  ``smem_bytes`` and the other ``variant_*`` attributes are the writer's.)
* ``FusedGemm``: cuBLASLt with the epilogue it can fold (bias; tanh-GELU without a
  residual; the residual as C when nothing follows it), then the stofc Add+Norm kernel for the rest
  (:func:`stofc.kernels.vendor_gemm.split_fused_gemm`, the C++ twin's
  ``split_fused_gemm``);
  ``epilogue_kernel`` ``FILE:ENTRY`` (``""`` when nothing is left),
  ``epilogue`` (its :class:`~stofc.kernels.epilogue.Epilogue` tag),
  ``epilogue_threads``, ``epilogue_rows``; and, when the tuner chose a cuBLASLt
  heuristic rank for the node's GEMM, ``lt_algo_m`` / ``lt_algo_rank``
  (:func:`lt_algo_attributes`).
  On an sm_90 package, a FusedGemm whose activation cuBLASLt cannot fold (the erf GELU),
  with a bias or none, no residual, a 16-bit output and K <= 1024 also gets ``hopper_gemm``
  ``FILE:ENTRY`` and ``hopper_gemm_min_m``: its twin runs that kernel
  (:mod:`stofc.kernels.gemm_ws`, one pass) for runs of at least that many rows
  (:func:`stofc.kernels.gemm_ws.twin_choice`).
* ``GatedGemm``: cuBLASLt computes ``x @ [Wg | Wu]`` with the bias folded, then the
  gated-activation kernel (:mod:`stofc.kernels.glu`, ``gemm/glu.cu.j2``, compiled for
  the node's ``activation`` and F) writes ``act(gate) * up``: ``epilogue_kernel``,
  ``epilogue_threads``, ``epilogue_rows`` (no ``epilogue`` tag: the entry name says the
  activation), and ``lt_algo_m`` / ``lt_algo_rank`` as FusedGemm's.
* ``Rotary``: ``kernel`` ``FILE:ENTRY`` of the rotary kernel compiled for the node's
  head_dim, rotary_dim and form (:mod:`stofc.kernels.rotary`, ``rope/rotary.cu.j2``) and
  ``kernel_abi``; the launch (one block per token, the kernel's threads) follows from them.
* ``EmbedLayerNorm``: ``kernel`` ``FILE:ENTRY`` of the embedding kernel compiled for the
  node (:mod:`stofc.kernels.embed_norm`, ``norm/embed_norm.cu.j2``: dtype, width, the summands
  present, beta, float32 gamma / beta in a bf16 package) and ``kernel_abi``; the entry name
  says all the twin checks, and the launch (a warp group per token, grid over the tokens)
  follows from it, as Rotary's does.
* ``AddLayerNorm``: the same four attributes naming the Add+Norm kernel compiled
  for the node (residual, LayerNorm/RMSNorm, beta, the ``sum`` output; in a bf16
  package a float32 ``x`` and float32 gamma/beta, entry ``..._f32in_f32p_...``).
  A bf16 package's FusedGemm with a float32 bias writes float32 directly
  (cuBLASLt D in fp32, no epilogue kernel) and gets no ``lt_algo_*``: the
  tuner's rank was measured for a bf16 output. An
  RMSNorm with a shift has no CUDA kernel (the template shifts LayerNorm only):
  such a node gets no ``kernel_abi`` and fails on the CUDA EP with that reason.

The Add+Norm kernels take the segment's tuned ``tpr``/``rows`` when its family has
them (:meth:`~stofc.kernels.registry.KernelFamily.twin_epilogue_config`: the vendor
and Add+Norm families), else the family default; :func:`annotate_cuda` returns the
ones the package does not build already, to be rendered and compiled with the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnx
from onnx import TensorProto, helper

from stofc.errors import PlanError
from stofc.kernels import catalog, gemm_ws, glu
from stofc.kernels import norm as norm_family
from stofc.kernels.embed_norm import EmbedNormProblem, check_problem, embed_norm_kernel
from stofc.kernels.epilogue import Epilogue
from stofc.kernels.registry import KernelInstance
from stofc.kernels.rotary import RotaryProblem, rotary_kernel
from stofc.kernels.vendor_gemm import split_fused_gemm
from stofc.lower.emit import KERNEL_ABI, EmittedSegment
from stofc.package.layout import kernel_file
from stofc.plan.plan import Plan, Segment

__all__ = ["KERNEL_ABI", "TwinLaunches", "annotate_cuda", "embed_norm_problem", "epilogue_kernel",
           "gated_epilogue_kernel", "gated_launch_attributes", "launch_attributes",
           "lt_algo_attributes", "norm_epilogue"]
TOKENS_HINT = 4096


def norm_epilogue(*, has_residual: bool, rms: bool, has_beta: bool, has_sum: bool) -> Epilogue | None:
    """The Add+Norm Epilogue of an AddLayerNorm node; None when no kernel implements it."""
    if rms and has_beta:
        return None
    return Epilogue(residual=has_residual, norm="rmsnorm" if rms else "layernorm",
                    norm_shift=rms or has_beta, store_pre_norm=has_sum)


def _set(node: onnx.NodeProto, **attrs: Any) -> None:
    keep = [a for a in node.attribute if a.name not in attrs]
    del node.attribute[:]
    node.attribute.extend(keep)
    node.attribute.extend(helper.make_attribute(k, v) for k, v in sorted(attrs.items()))


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _config(seg: Segment | None) -> norm_family.NormConfig | None:
    """The segment's tuned Add+Norm config (the family's, when it has one), else None."""
    if seg is None:
        return None
    try:
        fam = catalog.family_of(seg.kernel)
    except PlanError:
        return None
    return fam.twin_epilogue_config(seg.kernel)


def epilogue_kernel(ep: Epilogue, width: int, dtype: str,
                    config: norm_family.NormConfig | None = None, *, input_fp32: bool = False,
                    params_fp32: bool = False) -> KernelInstance:
    """The Add+Norm kernel applying ``ep`` to rows of ``width`` (default config).

    ``input_fp32``: x is float32 (a bf16 package's pre-LN GEMM result);
    ``params_fp32``: gamma / beta are float32 (a bf16 package's LayerNorm).
    """
    problem = norm_family.NormProblem(TOKENS_HINT, width, dtype, ep, input_fp32=input_fp32,
                                      params_fp32=params_fp32)
    cfg = config or norm_family.default_config(problem)
    return KernelInstance(norm_family.FAMILY, problem, cfg, norm_family.kernel_name(problem, cfg),
                          role="epilogue")


def gated_epilogue_kernel(act: str, features: int, dtype: str, config: Any = None
                          ) -> KernelInstance:
    """The gated-activation kernel GatedGemm's CUDA twin launches after cuBLASLt (which adds
    the bias): rows of ``features`` (F), the segment's tuned shape when it has one."""
    problem = glu.GatedProblem(TOKENS_HINT, features, dtype, act, bias=False)
    cfg = config if isinstance(config, glu.GatedConfig) else glu.gated_default(problem)
    return glu.gated_kernel(problem, cfg, role="epilogue")


def gated_launch_attributes(kernel: KernelInstance, kernel_path: str) -> dict[str, Any]:
    """GatedGemm's CUDA attributes for its gated-activation kernel at ``kernel_path``."""
    config = kernel.config
    return {"kernel_abi": KERNEL_ABI, "epilogue_kernel": f"{kernel_path}:{kernel.name}",
            "epilogue_threads": config.tpr * config.rows, "epilogue_rows": config.rows}


def launch_attributes(kernel: KernelInstance, ep: Epilogue, kernel_path: str) -> dict[str, Any]:
    """The FusedGemm / AddLayerNorm CUDA attributes for an Add+Norm kernel at ``kernel_path``."""
    config = kernel.config
    return {"kernel_abi": KERNEL_ABI, "epilogue_kernel": f"{kernel_path}:{kernel.name}",
            "epilogue": ep.tag, "epilogue_threads": config.tpr * config.rows,
            "epilogue_rows": config.rows}


def lt_algo_attributes(seg: Segment | None, width: int, plans: tuple[Plan, ...]
                       ) -> dict[str, Any]:
    """FusedGemm's ``lt_algo_m`` / ``lt_algo_rank`` (OPS.md) from the tuned vendor segments.

    The tuner records a cuBLASLt heuristic rank (valid for one M) with the M it was
    measured at on the segment's KernelSpec
    (:meth:`~stofc.kernels.registry.KernelFamily.twin_lt_rank`); the package's plan
    and every tuned bucket's plan (``plans``) contribute one (M, rank) pair when the
    node runs that segment's GEMM (same width: a packed Q|K|V node computes 3N where
    the segment tuned N, and gets none). ``{}`` when nothing was tuned.
    """
    pairs: dict[int, int] = {}
    if seg is None:
        return {}
    for plan in plans:
        twin = next((s for lp in plan.layers if lp.index == seg.layer for s in lp.segments
                     if s.ordinal == seg.ordinal and s.ops == seg.ops), None)
        if twin is None:
            continue
        try:
            tuned = catalog.family_of(twin.kernel).twin_lt_rank(twin.kernel)
        except PlanError:
            continue
        if tuned is None or twin.dim("n0") != width:
            continue
        pairs.setdefault(*tuned)
    if not pairs:
        return {}
    ms = sorted(pairs)
    return {"lt_algo_m": ms, "lt_algo_rank": [pairs[m] for m in ms]}


def embed_norm_problem(node: onnx.NodeProto, widths: dict[str, list[int]], fp32_inits: set[str],
                       dtype: str) -> EmbedNormProblem | None:
    """The kernel problem of an EmbedLayerNorm node: its summands (the present table inputs
    1, 3, 5), width (table_0's), beta and float gamma; None when no kernel implements it (the
    twin then fails at session creation on the CUDA EP, saying so)."""
    inputs = list(node.input) + [""] * 8
    width = widths.get(inputs[1], [0, 0])[-1]
    problem = EmbedNormProblem(dtype, width, sum(bool(inputs[i]) for i in (1, 3, 5)),
                               bool(inputs[7]), inputs[6] in fp32_inits)
    try:
        check_problem(problem)
    except PlanError:
        return None
    return problem


@dataclass(frozen=True)
class TwinLaunches:
    """What :func:`annotate_cuda` decided besides the attributes: the CUDA twins' epilogue
    kernels the package must also build (not among its other kernels; node order), and
    each attention launch plan file with the (layer, choice) whose launch data it holds."""

    epilogues: tuple[KernelInstance, ...]
    launch_plans: tuple[tuple[str, Any], ...]


def annotate_cuda(model: onnx.ModelProto, emitted: tuple[EmittedSegment, ...], plan: Plan,
                  buckets: tuple[tuple[int, Plan], ...], attention: dict[int, Any],
                  arch: str, built: set[str]) -> TwinLaunches:
    """Add the CUDA launch attributes to ``model``'s ai.stofc nodes (module doc).

    ``emitted``: the rewrite's EmittedSegments; ``attention``: each layer's
    :class:`~stofc.lower.attention.AttentionKernel`; ``arch``: the package's cubin
    target; ``built``: the names of the kernels the package builds anyway.
    """
    dtype = plan.dtype
    segs = {(s.layer, s.ordinal): s for lp in plan.layers for s in lp.segments}
    seg_of = {name: segs.get((e.layer, e.ordinal)) for e in emitted for name in e.nodes}
    layer_of = {name: e.layer for e in emitted for name in e.nodes}
    widths = {t.name: list(t.dims) for t in model.graph.initializer}
    fp32_inits = {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    # bf16 packages (stofc.lower.prenorm): a FusedGemm with a float32 bias writes float32
    fp32_values = {node.output[0] for node in model.graph.node
                   if node.domain == "ai.stofc" and node.op_type == "FusedGemm"
                   and len(node.input) > 2 and node.input[2] in fp32_inits}
    all_plans = (plan, *(p for _, p in buckets))
    pending: list[tuple[onnx.NodeProto, KernelInstance, Epilogue]] = []
    gated: list[tuple[onnx.NodeProto, KernelInstance]] = []
    direct: list[KernelInstance] = []   # kernels a twin launches by its `kernel` attribute
    launch_plans: dict[str, Any] = {}
    for node in model.graph.node:
        if node.domain != "ai.stofc":
            continue
        seg = seg_of.get(node.name)
        if node.op_type == "SparseAttention":
            ak = attention[layer_of[node.name]]
            files = []
            for choice in (ak.choice, *(v.choice for v in ak.variants)):
                rel = ak.launch_plan_file(choice)
                launch_plans.setdefault(rel, (ak, choice))
                files.append(rel)
            extra = {"variant_launch_plans": ";".join(files[1:])} if ak.variants else {}
            _set(node, launch_plan=files[0], kernel_abi=KERNEL_ABI, **extra)
            continue
        if node.op_type == "EmbedLayerNorm":
            embed = embed_norm_problem(node, widths, fp32_inits, dtype)
            if embed is not None:
                kernel = embed_norm_kernel(embed)
                _set(node, kernel_abi=KERNEL_ABI,
                     kernel=f"{kernel_file(kernel.name, arch)}:{kernel.name}")
                direct.append(kernel)
            continue
        if node.op_type == "Rotary":
            kernel = rotary_kernel(RotaryProblem(
                dtype, int(_attr(node, "head_dim", 0)), int(_attr(node, "rotary_dim", 0)),
                bool(_attr(node, "interleaved", 0))))
            _set(node, kernel_abi=KERNEL_ABI,
                 kernel=f"{kernel_file(kernel.name, arch)}:{kernel.name}")
            direct.append(kernel)
            continue
        inputs = list(node.input) + [""] * 4
        x_fp32 = params_fp32 = False
        if node.op_type == "GatedGemm":
            width = widths.get(inputs[1], [0, 0])[-1]
            _set(node, **lt_algo_attributes(seg, width, all_plans))
            if width:
                gated.append((node, gated_epilogue_kernel(
                    _text(_attr(node, "activation", "")), width // 2, dtype, _config(seg))))
            continue
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
            _set(node, **lt_algo_attributes(seg, width, all_plans))
        if node.op_type == "FusedGemm":
            hopper = gemm_ws.twin_choice(
                arch=arch, dtype=dtype, act=_text(_attr(node, "activation", "none")),
                has_bias=bool(inputs[2]), has_residual=bool(inputs[3]),
                fp32_out=node.output[0] in fp32_values, k=widths.get(inputs[1], [0, 0])[0],
                n=width)
            if hopper is not None:
                kernel = gemm_ws.gemm_ws_kernel(hopper)
                _set(node, hopper_gemm=f"{kernel_file(kernel.name, arch)}:{kernel.name}",
                     hopper_gemm_min_m=gemm_ws.MIN_ROWS)
                direct.append(kernel)
        if ep is None or not width:
            continue                      # no CUDA kernel: the twin says so at session creation
        if ep.is_identity:
            _set(node, kernel_abi=KERNEL_ABI, epilogue_kernel="")
            continue
        kernel = epilogue_kernel(ep, width, dtype, _config(seg), input_fp32=x_fp32,
                                 params_fp32=params_fp32)
        pending.append((node, kernel, ep))
    kernels = {k.name: k for _, k, _ in pending} | {k.name: k for _, k in gated} | \
        {k.name: k for k in direct}
    for node, kernel, ep in pending:
        _set(node, **launch_attributes(kernel, ep, kernel_file(kernel.name, arch)))
    for node, kernel in gated:
        _set(node, **gated_launch_attributes(kernel, kernel_file(kernel.name, arch)))
    fresh = tuple(k for name, k in kernels.items() if name not in built)
    return TwinLaunches(fresh, tuple(launch_plans.items()))
