"""Fusion plans: which operators of a layer chain run together, and on which kernel.

Public API (no GPU anywhere in this package)::

    from stofc.plan import build_plan, Plan
    plan = build_plan(model_graph, mask_format, get_profile("h100"),
                      dtype="float16", max_seq_len=512, batch=8)
    plan.to_json(); Plan.from_json(text); plan.summary()

Pieces, by module:

* :mod:`.scheme`   — :class:`FusionScheme`, STOF's one-value-per-operator encoding.
* :mod:`.families` — :func:`match_segments` maps every segment to a kernel family
  (attention, gemm, gemm_norm, gemm_gemm, add_norm) or raises
  :class:`SchemeRejected` with the reason; :func:`reject_reason` returns it.
* :mod:`.moves`    — :func:`initial_scheme` (rules and recognised structures) and the
  stage-1 moves the tuner drives: :func:`expand`, :func:`seize`, :func:`compete`,
  :func:`neighbours` (every executable scheme one move away).
* :mod:`.build`    — :func:`build_plan`, :func:`plan_layer`, :func:`kernel_spec`
  (analytical default kernels; the vendor path for GEMMs by measurement).
* :mod:`.plan`     — the frozen :class:`Plan`, :class:`LayerPlan`, :class:`Segment`,
  :class:`KernelSpec` and the versioned ``plan.json`` form.
* :mod:`.dataflow` — activation dataflow of a frontend chain (what each op reads).
* :mod:`.synthetic`— hand-built BERT / GPT-2 / ViT / T5 layers for tests and benches.
"""

from stofc.plan.build import build_plan, kernel_spec, plan_layer
from stofc.plan.families import SchemeRejected, SegmentMatch, match_segments, reject_reason
from stofc.plan.moves import Move, compete, expand, initial_scheme, neighbours, seize
from stofc.plan.plan import SCHEMA_VERSION, KernelSpec, LayerPlan, Plan, Segment
from stofc.plan.scheme import FusionScheme

__all__ = [
    "SCHEMA_VERSION",
    "FusionScheme",
    "KernelSpec",
    "LayerPlan",
    "Move",
    "Plan",
    "SchemeRejected",
    "Segment",
    "SegmentMatch",
    "build_plan",
    "compete",
    "expand",
    "initial_scheme",
    "kernel_spec",
    "match_segments",
    "neighbours",
    "plan_layer",
    "reject_reason",
    "seize",
]
