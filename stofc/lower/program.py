"""The lowering stage: a (tuned) plan -> everything the package holds, decided, nothing built.

:func:`lower_plan` takes the model graph, the plan (with its tuned buckets), the
encoded masks and the GPU profile and decides, without rendering or compiling
anything:

* every kernel the package builds: each segment's (its family's
  :meth:`~stofc.kernels.registry.KernelFamily.kernels`, main first), each layer's
  attention kernels (:mod:`stofc.lower.attention`: the base kernel and its
  run-time variants), and the CUDA twins' epilogue kernels
  (:func:`stofc.lower.twins.annotate_cuda`);
* the rewritten model (:func:`stofc.lower.rewrite.rewrite_model`) with every
  launch attribute set, the kernel files it names included (their names are the
  kernels' names; ``stofc.package.layout`` says where they go);
* each attention launch plan file and its launch data
  (:func:`stofc.kernels.attention.launch.launch_data`, computed here once).

The result, a :class:`Program`, is what the render, compile and write stages take.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import onnx

from stofc.errors import PlanError
from stofc.frontend.types import ModelGraph
from stofc.kernels import catalog
from stofc.kernels.attention.family import NO_ATTENTION_KERNEL, AttentionFamily
from stofc.kernels.attention.launch import LaunchData
from stofc.kernels.registry import KernelInstance, PlanContext
from stofc.lower.attention import AttentionKernel, attention_kernels
from stofc.lower.emit import AttentionBinding, EmittedSegment
from stofc.lower.rewrite import rewrite_model
from stofc.lower.twins import TOKENS_HINT, annotate_cuda
from stofc.masks.layers import LayerMasks
from stofc.package.layout import kernel_file, mask_files
from stofc.plan.plan import Plan, Segment, TunedPlan
from stofc.targets import GpuProfile


@dataclass(frozen=True, eq=False)
class Program:
    """Everything a package holds, decided (see the module doc).

    ``kernels``: the plan's kernels, each once (by name); ``twins``: the CUDA twins'
    epilogue kernels not among them (node order); ``refs[(layer, ordinal)]``: the
    ``FILE:ENTRY`` of a segment's main kernel; ``launch_plans``: ``(file, data)``.
    """

    plan: Plan
    buckets: tuple[tuple[int, Plan], ...]
    tuned: bool
    masks: LayerMasks
    profile: GpuProfile
    targets: tuple[str, ...]
    model: onnx.ModelProto
    emitted: tuple[EmittedSegment, ...]
    kernels: tuple[KernelInstance, ...]
    twins: tuple[KernelInstance, ...]
    refs: dict[tuple[int, int], str]
    attention: dict[int, AttentionKernel]
    launch_plans: tuple[tuple[str, LaunchData], ...]
    pack_qkv: bool = True

    @property
    def arch(self) -> str:
        """The package's cubin target."""
        return self.targets[0]


def segment_kernels(seg: Segment, dtype: str) -> tuple[KernelInstance, ...]:
    """The kernels of a non-attention segment, main first (its family's, at the M hint)."""
    fam = catalog.family_of(seg.kernel)
    ctx = PlanContext(tokens=TOKENS_HINT, dtype=dtype, profile=None,
                      store=seg.kernel.param("store", "row"))
    problem = fam.problem(seg, ctx)
    return fam.kernels(problem, fam.config_of(seg.kernel, problem))


def _ref(kernel: KernelInstance, arch: str) -> str:
    return f"{kernel_file(kernel.name, arch)}:{kernel.name}"


def _attention_attributes(ak: AttentionKernel, arch: str) -> tuple[tuple[str, Any], ...]:
    """SparseAttention's launch attributes and its run-time variants' (OPS.md)."""
    base = ak.launch(ak.choice)
    if not ak.variants:
        return base
    launches = [dict(ak.launch(v.choice)) for v in ak.variants]
    return (*base,
            ("variant_kernels", ";".join(_ref(ak.instance(v.choice), arch)
                                         for v in ak.variants)),
            *((f"variant_{key}", [launch[key] for launch in launches])
              for key in ("block_threads", "blocks_per_tile_row", "smem_bytes")),
            ("variant_max_seq_len", [v.max_seq_len for v in ak.variants]),
            ("variant_max_batch_rows", [v.max_batch_rows for v in ak.variants]))


def _recorded(plan: Plan, attention: dict[int, AttentionKernel]) -> Plan:
    """``plan`` with each attention segment's spec the base kernel's, as its family writes it
    (a tuned or given plan may name its config in another form's record)."""
    layers = []
    for lp in plan.layers:
        segs = []
        for seg in lp.segments:
            ak = attention.get(seg.layer)
            if ak is not None and seg.family == "attention" and seg.kernel != NO_ATTENTION_KERNEL:
                seg = replace(seg, kernel=ak.family().spec(ak.problem, ak.choice.config))
            segs.append(seg)
        layers.append(replace(lp, segments=tuple(segs)))
    return replace(plan, layers=tuple(layers))


def lower_plan(graph: ModelGraph, tuned: TunedPlan, masks: LayerMasks, profile: GpuProfile, *,
               pack_qkv: bool = True,
               length_masks: Mapping[int, LayerMasks] | None = None) -> Program:
    """Lower ``tuned`` for ``graph`` on ``masks`` into a :class:`Program` (module doc).

    ``pack_qkv`` packs each layer's Q, K, V GEMMs into one node where it can
    (:func:`~stofc.lower.rewrite.rewrite_model`). ``length_masks``: the masks encoded at
    each sequence-length bucket, where an untuned plan's selector picks per bucket
    (:mod:`stofc.lower.attention`).
    """
    plan = tuned.plan
    targets = (profile.arch, profile.ptx_target)
    arch = targets[0]
    attention = attention_kernels(graph, tuned, masks, profile, length_masks)
    plan = _recorded(plan, attention)
    per_segment: dict[tuple[int, int], tuple[KernelInstance, ...]] = {}
    for lp in plan.layers:
        for seg in lp.segments:
            if seg.kernel == NO_ATTENTION_KERNEL:
                raise PlanError(f"layer {seg.layer}'s attention segment has no kernel: the plan "
                                "was built without the mask formats",
                                hint="build it with the encoded masks (build_plan(graph, masks, "
                                     "...) or plan_layer(..., fmt=...))")
            fam = catalog.family_of(seg.kernel)
            per_segment[(seg.layer, seg.ordinal)] = (
                attention[seg.layer].instances() if isinstance(fam, AttentionFamily)
                else segment_kernels(seg, plan.dtype))
    refs = {key: _ref(kernels[0], arch) for key, kernels in per_segment.items() if kernels}
    bindings = {}
    for layer, ak in attention.items():
        main = next(refs[(s.layer, s.ordinal)] for lp in plan.layers if lp.index == layer
                    for s in lp.segments if isinstance(catalog.family_of(s.kernel),
                                                       AttentionFamily))
        bindings[layer] = AttentionBinding(layer, mask_files(ak.problem.fmt)[1], main,
                                           ak.key_padding_mask, ak.bias,
                                           _attention_attributes(ak, arch))
    model, emitted = rewrite_model(graph, plan, refs, bindings, pack_qkv=pack_qkv)
    unique = {k.name: k for kernels in per_segment.values() for k in kernels}
    twins = annotate_cuda(model, emitted, plan, tuned.buckets, attention, arch, set(unique))
    launch_plans = tuple((rel, ak.launch_data(choice)) for rel, (ak, choice) in twins.launch_plans)
    return Program(plan=plan, buckets=tuned.buckets, tuned=tuned.tuned, masks=masks,
                   profile=profile, targets=targets, model=model, emitted=emitted,
                   kernels=tuple(unique[n] for n in sorted(unique)), twins=twins.epilogues,
                   refs=refs, attention=attention, launch_plans=launch_plans,
                   pack_qkv=pack_qkv)
