"""``tune_plan``: a plan's schemes and kernel configs chosen by measurement, per length bucket.

Input: a :class:`~stofc.plan.plan.Plan` (``stofc.plan.build.build_plan``'s
analytical default), the model's layers (the frontend ``ModelGraph`` or its
``layers``: stage 1 re-partitions their operator chains, the runners name the
weights), the attention mask (a :class:`~stofc.masks.MaskFormat`, a spec
encoded for the plan's ``max_seq_len``, or a mapping layer index -> format),
the GPU profile, ``batch`` and the sequence-length buckets.

Layers whose chains are alike (same operators and parameters up to weight
names: BERT's 12) under the same mask form one group, tuned once through one representative:
:func:`stofc.tune.engine.tune_chain` over a
:class:`~stofc.tune.adapters.LayerSchemeSpace` whose segment spaces are the
real families' (:class:`~stofc.tune.spaces.SpaceFactory`) and whose start is
the plan's own scheme (other buckets: the same rules ``build_plan`` uses).
One :class:`~stofc.tune.evaluate.Evaluator` is shared by every (bucket,
group), so a segment equal in two places is measured once; the budget is split
evenly among them. The chosen scheme and the verified configs are written
back into every layer of the group as the plan's
:class:`~stofc.plan.plan.KernelSpec` values (same templates and parameter
order as the analytical ones; a segment without a verified winner keeps its
default).

:func:`tune_plan_buckets` returns one tuned :class:`Plan` per bucket
(``tokens = batch x bucket``) with the default-vs-tuned times per segment;
:func:`tune_plan` returns the plan of the largest bucket.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from stofc.errors import PlanError
from stofc.frontend.types import Layer
from stofc.masks import encode
from stofc.masks.format import MaskFormat
from stofc.masks.layers import LayerMasks
from stofc.plan.build import PREFER_VENDOR_GEMM, default_scheme, plan_layer
from stofc.plan.plan import KernelSpec, LayerPlan, Plan, TunedPlan
from stofc.plan.scheme import FusionScheme
from stofc.targets import GpuProfile
from stofc.tune.adapters import LayerSchemeSpace
from stofc.tune.db import RecordKey, TuningDatabase
from stofc.tune.engine import TuneResult, tune_chain
from stofc.tune.evaluate import Evaluator, EvaluatorStats
from stofc.tune.interfaces import Config, Measurer, Scheme, SegmentSpace
from stofc.tune.progress import QuietReporter, Reporter
from stofc.tune.runners import gpu_measurer
from stofc.tune.spaces import KernelSegment, SpaceFactory

_NAME_PARAMS = ("weight", "bias", "scale")


@dataclass(frozen=True)
class SegmentTiming:
    """One segment of the tuned chain (or of the default chain): config and time."""

    label: str
    family: str
    config: str
    default_ms: float | None        # the segment's analytical default config
    tuned_ms: float | None          # the config the tuned plan uses
    verified: bool


@dataclass(frozen=True)
class BucketResult:
    """One (bucket, layer group): the tuned plan layers' chain vs the default chain.

    ``default_chain_ms``: the plan's default scheme with default configs, one
    layer; ``tuned_chain_ms``: the tuned scheme with tuned configs. ``None``
    where a segment had no successful measurement.
    """

    seq_len: int
    layers: tuple[int, ...]
    default_scheme: str
    tuned_scheme: str
    default_segments: tuple[SegmentTiming, ...]
    tuned_segments: tuple[SegmentTiming, ...]
    default_chain_ms: float | None
    tuned_chain_ms: float | None
    result: TuneResult


@dataclass(frozen=True)
class PlanTuning:
    """Every bucket's tuned plan, the per-group results, what was measured, the wall time."""

    plans: tuple[tuple[int, Plan], ...]
    groups: tuple[BucketResult, ...]
    stats: EvaluatorStats
    elapsed_s: float

    def plan_for(self, seq_len: int) -> Plan:
        """The plan of the smallest bucket holding ``seq_len`` (the largest one otherwise)."""
        for length, plan in sorted(self.plans, key=lambda p: p[0]):
            if seq_len <= length:
                return plan
        return max(self.plans, key=lambda p: p[0])[1]


class PlanSchemeSpace(LayerSchemeSpace):
    """A :class:`LayerSchemeSpace` that starts from a given scheme (the plan's).

    ``known``: a scheme stage 1 already chose (from the database); stage 1
    then starts there and proposes no move.
    """

    def __init__(self, layer: Any, *, tokens: int, segment_space: Any,
                 start: FusionScheme, known: Scheme | None = None) -> None:
        super().__init__(layer, tokens=tokens, segment_space=segment_space)
        self.start = start
        self.known = known

    def initial(self) -> Scheme:
        return Scheme(self.start.codes).canonical()

    def search_start(self) -> PlanSchemeSpace:
        """The space stage 1 searches: from the known scheme, frozen, when there is one."""
        if self.known is None:
            return self
        frozen = PlanSchemeSpace(self.layer, tokens=self.tokens,
                                 segment_space=self.segment_space,
                                 start=FusionScheme.from_values(list(self.known.values)))
        frozen.moves = lambda scheme: []  # type: ignore[method-assign]
        frozen._segments = self._segments
        return frozen


def scheme_record_key(measurer: Measurer, layer: Layer, factory: SpaceFactory) -> RecordKey:
    """The database key of a chain's stage-1 result (one per chain shape, bucket and GPU)."""
    fmt = factory.mask
    problem = [hashlib.sha256(repr(chain_signature(layer)).encode()).hexdigest()[:24],
               factory.batch, factory.seq_len, factory.dtype, factory.qkv_store,
               getattr(fmt, "spec_hash", ""), factory.profile.arch]
    return RecordKey(family="scheme", problem=json.dumps(problem, separators=(",", ":")),
                     gpu=measurer.gpu, driver=measurer.driver, compile_options="[]")


def _known_scheme(db: TuningDatabase | None, key: RecordKey, n_ops: int) -> Scheme | None:
    record = db.best(key) if db is not None else None
    if record is None:
        return None
    values = json.loads(record.config).get("scheme")
    return Scheme(tuple(values)).canonical() if values and len(values) == n_ops else None


def chain_signature(layer: Layer) -> tuple:
    """What makes two layers' chains tune alike: operators and parameters, not names."""
    ops = tuple((op.kind.value, op.role,
                 tuple((k, v) for k, v in op.params if k not in _NAME_PARAMS and k != "layer"))
                for op in layer.chain)
    block = layer.attention
    return (layer.norm_order, block.num_heads, block.head_dim, block.hidden_size,
            round(float(block.scale or 0.0), 9), ops)


def _qkv_store(layer_plan: LayerPlan) -> str:
    for seg in layer_plan.segments:
        if set(seg.roles) & {"qkv", "q", "k", "v"} and seg.kernel.param("store"):
            return str(seg.kernel.param("store"))
    return "row"


def _mask_format(mask: Any, plan: Plan, layer: Layer) -> Any:
    """The layer's mask format: from per-layer masks, a format, or a spec (encoded)."""
    if isinstance(mask, LayerMasks):
        mask = mask.formats
    if isinstance(mask, Mapping):
        mask = mask.get(layer.index)
    if mask is None or isinstance(mask, MaskFormat):
        return mask
    return encode(mask, plan.max_seq_len, tile=64, layer=layer.index,
                  num_heads=layer.attention.num_heads)


def _time(evaluator: Evaluator, space: SegmentSpace, config: Config | None) -> float | None:
    if config is None:
        return None
    m = evaluator.memo(space).get(config.key)
    return m.time_ms if m is not None and m.ok else None


def _chain_ms(rows: tuple[SegmentTiming, ...], attr: str) -> float | None:
    values = [getattr(r, attr) for r in rows]
    return None if any(v is None for v in values) else float(sum(values))


def _start_scheme(layer: Layer, layer_plan: LayerPlan, tokens: int, plan: Plan,
                  profile: GpuProfile) -> FusionScheme:
    if tokens == plan.tokens:
        return layer_plan.scheme
    return default_scheme(layer, tokens, profile)


def _write_back(layer: Layer, scheme: FusionScheme, specs: list[KernelSpec], *, tokens: int,
                plan: Plan, profile: GpuProfile, qkv_store: str) -> LayerPlan:
    base = plan_layer(layer, scheme, tokens=tokens, profile=profile, dtype=plan.dtype,
                      max_seq_len=plan.max_seq_len, qkv_store=qkv_store,
                      vendor=PREFER_VENDOR_GEMM)
    if len(base.segments) != len(specs):
        raise PlanError(f"layer {layer.index}: the tuned scheme maps to {len(base.segments)} "
                        f"segments, the tuner chose {len(specs)} kernels",
                        hint="this is a stofc bug; report it")
    segments = tuple(dataclasses.replace(seg, kernel=spec)
                     for seg, spec in zip(base.segments, specs, strict=True))
    return dataclasses.replace(base, segments=segments)


def tune_plan_buckets(plan: Plan, model_graph: Any, mask: Any, profile: GpuProfile, *,
                      batch: int, seq_lens: tuple[int, ...] = (), budget_s: float | None = None,
                      db: TuningDatabase | None = None, reporter: Reporter | None = None,
                      measurer: Measurer | None = None, seed: int = 0,
                      stage1_share: float = 0.5) -> PlanTuning:
    """Tune ``plan`` for every bucket of ``seq_lens`` (see the module doc).

    ``measurer``: default a GPU :func:`~stofc.tune.runners.gpu_measurer`
    (closed at the end). ``seq_lens``: default the plan's ``max_seq_len``;
    each must be at most it (the mask format's ``L_max``). A stage-1 search
    that converged is stored in ``db`` (family ``"scheme"``), so a warm run
    starts from that scheme and measures nothing it measured before.
    """
    started = time.monotonic()
    layers = list(getattr(model_graph, "layers", model_graph) or ())
    if len(layers) != len(plan.layers):
        raise PlanError(f"tune_plan got {len(layers)} model layers for a plan of "
                        f"{len(plan.layers)}", hint="pass the model graph the plan was built from")
    lengths = tuple(sorted(set(seq_lens or (plan.max_seq_len,))))
    too_long = [n for n in lengths if n > plan.max_seq_len or n < 1]
    if too_long:
        raise PlanError(f"sequence-length bucket {too_long[0]} is outside 1..{plan.max_seq_len} "
                        "(the plan's max_seq_len)",
                        hint="tune lengths up to the length the package was compiled for")
    if batch < 1:
        raise PlanError(f"batch {batch} is not positive", hint="give a batch size >= 1")
    formats = [_mask_format(mask, plan, layer) for layer in layers]
    reporter = reporter or QuietReporter()
    own = measurer is None
    if measurer is None:
        measurer = cast(Measurer, gpu_measurer())
    groups: dict[tuple, list[int]] = {}
    for i, layer in enumerate(layers):   # alike chains under the same mask
        groups.setdefault((chain_signature(layer), getattr(formats[i], "spec_hash", None)),
                          []).append(i)
    jobs = [(n, members) for n in lengths for members in groups.values()]
    share = None if budget_s is None else budget_s / len(jobs)
    evaluator = Evaluator(measurer, db)
    new_layers: dict[int, dict[int, LayerPlan]] = {n: {} for n in lengths}
    results: list[BucketResult] = []
    try:
        for seq_len, members in jobs:
            rep, rep_plan = layers[members[0]], plan.layers[members[0]]
            tokens = batch * seq_len
            own_defaults = tokens == plan.tokens
            factory = SpaceFactory(rep, batch, seq_len, plan.dtype, profile, formats[members[0]],
                                   _qkv_store(rep_plan),
                                   tuple((s.ops, s.kernel) for s in rep_plan.segments)
                                   if own_defaults else ())
            key = scheme_record_key(measurer, rep, factory)
            space = PlanSchemeSpace(rep, tokens=tokens, segment_space=factory,
                                    start=_start_scheme(rep, rep_plan, tokens, plan, profile),
                                    known=_known_scheme(db, key, len(rep.chain)))
            reporter.stage("bucket", f"L={seq_len}, batch {batch}: layers "
                           f"{members[0]}..{members[-1]} ({len(members)} alike)"
                           + (", scheme from the database" if space.known else ""))
            result = tune_chain(space.search_start(), measurer, reporter, db=db,
                                budget_s=share, evaluator=evaluator, seed=seed,
                                stage1_share=stage1_share)
            if (db is not None and space.known is None and result.stage1.stopped == "converged"
                    and math.isfinite(result.stage1.cost_ms)):
                db.upsert_best(key, json.dumps({"scheme": list(result.scheme.values)}),
                               result.stage1.cost_ms)
            group = _group_result(space, result, evaluator, seq_len, tuple(members))
            results.append(group)
            tuned = [s for s in space.segments(result.scheme)]
            specs = [seg.kernel_spec(_chosen(result, seg)) for seg in tuned
                     if isinstance(seg, KernelSegment)]
            scheme = FusionScheme.from_values(list(result.scheme.values))
            for i in members:
                new_layers[seq_len][i] = _write_back(
                    layers[i], scheme, specs, tokens=tokens, plan=plan, profile=profile,
                    qkv_store=_qkv_store(plan.layers[i]))
    finally:
        if own:
            close = getattr(measurer, "close", None)
            if close is not None:
                close()
    plans = tuple((n, Plan(gpu=profile.name, arch=profile.arch, dtype=plan.dtype,
                           max_seq_len=plan.max_seq_len, tokens=batch * n, mask=plan.mask,
                           layers=tuple(new_layers[n][i] for i in range(len(layers)))))
                  for n in lengths)
    return PlanTuning(plans=plans, groups=tuple(results), stats=evaluator.stats,
                      elapsed_s=time.monotonic() - started)


def _chosen(result: TuneResult, segment: SegmentSpace) -> Config:
    """The verified winner of ``segment`` in ``result``, else its default config."""
    for r in result.stage2.segments:
        if (r.family == segment.family and tuple(r.problem) == tuple(segment.problem)
                and r.best is not None and r.verified):
            return r.best
    return segment.default_config()


def _group_result(space: PlanSchemeSpace, result: TuneResult, evaluator: Evaluator,
                  seq_len: int, members: tuple[int, ...]) -> BucketResult:
    def rows(scheme: Scheme, tuned: bool) -> tuple[SegmentTiming, ...]:
        out = []
        for seg in space.segments(scheme):
            default = seg.default_config() if seg.configs() else None
            chosen = _chosen(result, seg) if tuned else default
            verified = any(r.verified and r.family == seg.family
                           and tuple(r.problem) == tuple(seg.problem)
                           for r in result.stage2.segments) if tuned else False
            out.append(SegmentTiming(seg.label, seg.family, "-" if chosen is None else chosen.key,
                                     _time(evaluator, seg, default), _time(evaluator, seg, chosen),
                                     verified))
        return tuple(out)

    initial = space.initial()
    default_rows, tuned_rows = rows(initial, False), rows(result.scheme, True)
    return BucketResult(seq_len=seq_len, layers=members, default_scheme=str(initial),
                        tuned_scheme=str(result.scheme), default_segments=default_rows,
                        tuned_segments=tuned_rows,
                        default_chain_ms=_chain_ms(default_rows, "default_ms"),
                        tuned_chain_ms=_chain_ms(tuned_rows, "tuned_ms"), result=result)


def tune_plan(plan: Plan, model_graph: Any, mask: Any, profile: GpuProfile, *, batch: int,
              seq_lens: tuple[int, ...] = (), budget_s: float | None = None,
              db: TuningDatabase | None = None, reporter: Reporter | None = None,
              measurer: Measurer | None = None, seed: int = 0) -> Plan:
    """The tuned plan of the largest bucket (see :func:`tune_plan_buckets`)."""
    tuning = tune_plan_buckets(plan, model_graph, mask, profile, batch=batch, seq_lens=seq_lens,
                               budget_s=budget_s, db=db, reporter=reporter, measurer=measurer,
                               seed=seed)
    return tuning.plan_for(max(n for n, _ in tuning.plans))


def tune_stage(plan: Plan, model_graph: Any, masks: Any, profile: GpuProfile,
               db: TuningDatabase | None, reporter: Reporter | None, *, budget_s: float | None,
               batch: int, seq_lens: tuple[int, ...] = (), seed: int = 0,
               measurer: Measurer | None = None) -> TunedPlan:
    """The road's tune stage: ``plan`` tuned for every bucket of ``seq_lens`` (default its
    ``max_seq_len``) on the GPU present, as the :class:`~stofc.plan.plan.TunedPlan` the
    package is built from: the largest bucket's plan, every bucket's, and the report."""
    lengths = tuple(sorted(set(seq_lens))) or (plan.max_seq_len,)
    tuning = tune_plan_buckets(plan, model_graph, masks, profile, batch=batch, seq_lens=lengths,
                               budget_s=budget_s, db=db, reporter=reporter, measurer=measurer,
                               seed=seed)
    return TunedPlan(tuning.plan_for(lengths[-1]),
                     tuple((n, tuning.plan_for(n)) for n in lengths), tuned=True, report=tuning)
