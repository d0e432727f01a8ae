"""Kernel families as registered units: one module each, found by name, spec or segment.

A *kernel family* is one way to execute one kind of plan segment on the GPU (the
segment kinds are :mod:`stofc.plan.families`': ``attention``, ``gemm``,
``gemm_norm``, ``gemm_gemm``, ``add_norm``). Several families may execute one
kind: a ``gemm`` segment runs on the hand-written GEMM template or on cuBLASLt
plus an epilogue kernel; an ``attention`` segment on the block-wise or the
row-wise kernel. Each family is a :class:`KernelFamily` subclass in its own
module under ``stofc/kernels/``, registered with :func:`register`:

.. code-block:: python

    @register
    class GemmGemm(KernelFamily[GemmGemmProblem, GemmGemmConfig]):
        name = "gemm_gemm"
        segments = ("gemm_gemm",)
        templates = ("gemm/gemm_gemm.cu.j2",)
        ...

It owns everything about its kernels: the problem it solves (from a segment),
its frozen Config type, the search space with the reasons it prunes, the
analytical default, the conversion between a Config and the plan's
:class:`~stofc.plan.plan.KernelSpec` (what plan.json stores), the kernels it
launches (:class:`KernelInstance`, rendered from its templates) and the NVRTC
target and options they compile with. Attention families add the selector's
cost model, launch attributes and launch data
(:class:`stofc.kernels.attention.family.AttentionFamily`).

The planner, the tuner, the renderer, the package writer and the runtimes ask
this registry through :mod:`stofc.kernels.catalog` (which imports every built-in
family module, then offers these lookups); nothing else branches on a family's
name. Registering a second family under a taken name, or a second owner of a
(segment, template) pair, is a :class:`RegistryError` at import time.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from stofc.codegen import Source
from stofc.errors import PlanError, RegistryError
from stofc.kernels.epilogue import Epilogue
from stofc.kernels.space import Space
from stofc.kernels.spec import KernelSpec
from stofc.targets import GpuProfile

P = TypeVar("P")
C = TypeVar("C")
ParamValue = int | float | str | bool


class SegmentView(Protocol):
    """What a family reads of a segment: a :class:`~stofc.plan.plan.Segment` or a
    :class:`~stofc.plan.families.SegmentMatch`."""

    @property
    def family(self) -> str: ...

    @property
    def epilogues(self) -> tuple[Epilogue, ...]: ...

    @property
    def dims(self) -> tuple[tuple[str, int], ...]: ...

    @property
    def roles(self) -> tuple[str, ...]: ...

    def dim(self, name: str) -> int: ...

    def binding(self, slot: str) -> str | None: ...


@dataclass(frozen=True)
class PlanContext:
    """What a family needs besides the segment to state its problem.

    ``tokens``: the M configs are chosen for (batch x length); ``store``: the GEMM
    output layout the plan asks of this segment (``row`` or ``heads``); ``qkv_store``:
    the plan's layout of the Q/K/V projections (what attention reads). Attention
    families read ``attention`` (the layer's :class:`~stofc.frontend.types.AttentionBlock`),
    ``fmt`` (its :class:`~stofc.masks.format.MaskFormat`), ``batch`` and ``seq_len``,
    and ``key_padding`` / ``bias`` (whether its SparseAttention reads a key padding
    mask / an additive score bias, :func:`stofc.plan.attention.attention_inputs`).
    ``variants``: the plan serves every shape, with run-time variants where a family
    has them (the base kernel is chosen); False: the config for exactly this shape
    (the tuner's starting point).
    """

    tokens: int
    dtype: str
    profile: GpuProfile | None
    store: str = "row"
    qkv_store: str = "row"
    attention: Any = None
    fmt: Any = None
    batch: int = 1
    seq_len: int = 0
    key_padding: bool = False
    bias: bool = False
    variants: bool = True


@dataclass(frozen=True)
class KernelInstance:
    """One kernel to render and compile: a family's problem and config, and its name.

    ``role`` says what it does for its segment (``main`` first; ``finisher`` for
    GEMM+GEMM's workspace pass, ``epilogue`` for a CUDA twin's Add+Norm pass).
    ``name`` is the rendered source's name and entry point.
    """

    family: str
    problem: Any
    config: Any
    name: str
    role: str = "main"


class KernelFamily(ABC, Generic[P, C]):
    """One registered kernel family (see the module doc). Subclasses set the class
    attributes and implement the abstract methods; the defaults serve dataclass configs.

    * ``name``: the registry key (also the tuner's and runtime's key for it).
    * ``segments``: the plan segment kinds it executes.
    * ``templates``: the ``KernelSpec.template`` values its specs carry (the first is
      what :meth:`spec` writes).
    * ``config_type``: its frozen Config dataclass.
    * ``preference``: lower first: the analytical default of a segment is the first
      applicable family's (attention: the selector's cost model decides instead).
    * ``space_order``: lower first in a segment's merged tuning space.
    * ``tuner_tag``: items the tuner adds to this family's configs, so a segment
      whose space merges several families can tell whose a config is.
    * ``vendor``: the family runs a vendor library (``plan_layer(vendor=False)``
      keeps the hand-written kernels only).
    * ``compile_options``: NVRTC options of its kernels.
    * ``tunable``: the tuner measures it (``untunable`` / ``untunable_hint``: why not, for a
      segment kind no family of which is tunable).
    """

    name: ClassVar[str]
    segments: ClassVar[tuple[str, ...]]
    templates: ClassVar[tuple[str, ...]]
    config_type: ClassVar[type]
    preference: ClassVar[int] = 100
    space_order: ClassVar[int] = 100
    tuner_tag: ClassVar[tuple[tuple[str, ParamValue], ...]] = ()
    vendor: ClassVar[bool] = False
    compile_options: ClassVar[tuple[str, ...]] = ()
    tunable: ClassVar[bool] = True
    untunable: ClassVar[str] = "has no tunable kernel"
    untunable_hint: ClassVar[str] = "tune other segments"

    # -- planning ----------------------------------------------------------------
    @abstractmethod
    def problem(self, seg: SegmentView, ctx: PlanContext) -> P:
        """The problem ``seg`` poses to this family (shapes, dtype, epilogue, layout)."""

    def choose(self, peers: tuple[KernelFamily[Any, Any], ...], seg: SegmentView,
               ctx: PlanContext) -> KernelSpec | None:
        """A segment kind whose families compete by a cost model chooses here (asked of
        the kind's first family); None: the first applicable family's default wins."""
        return None

    def unsupported(self, problem: P, profile: GpuProfile) -> str | None:
        """Why this family cannot run ``problem`` on ``profile`` at all; None when it can."""
        return None

    @abstractmethod
    def space(self, problem: P, profile: GpuProfile) -> Space:
        """The declared search space with its pruning constraints (``Space.explain``)."""

    def candidates(self, problem: P, profile: GpuProfile) -> tuple[list[C], dict[str, int]]:
        """Every valid config of :meth:`space` and how many candidates each reason pruned."""
        space = self.space(problem, profile)
        configs = [self.config_type(**c) for c in space.configs()]
        reasons = {k: v for k, v in space.explain().items() if k != "valid"}
        return configs, reasons

    @abstractmethod
    def default(self, problem: P, profile: GpuProfile) -> C | None:
        """The analytical default config (None: nothing of this family fits)."""

    @abstractmethod
    def spec(self, problem: P, config: C) -> KernelSpec:
        """The plan's KernelSpec of ``config`` (segment kind, template, parameters)."""

    @abstractmethod
    def config_of(self, spec: KernelSpec, problem: P | None) -> C:
        """The config a KernelSpec of this family names (inverse of :meth:`spec`); the
        problem, when given, may tell what of the spec applies to it."""

    # -- tuning ------------------------------------------------------------------
    def params(self, config: C) -> dict[str, ParamValue]:
        """The tuner's flat form of ``config`` (its fields plus :attr:`tuner_tag`)."""
        return {**dict(self.tuner_tag), **dataclasses.asdict(config)}  # type: ignore[call-overload]

    def from_params(self, params: Mapping[str, Any]) -> C:
        """Inverse of :meth:`params` (fields the mapping lacks take their defaults)."""
        names = {f.name for f in dataclasses.fields(self.config_type)}
        return self.config_type(**{k: v for k, v in params.items() if k in names})

    def owns(self, params: Mapping[str, Any]) -> bool:
        """Whether a tuner config of a merged space is this family's (its tag matches)."""
        return all(params.get(k) == v for k, v in self.tuner_tag)

    def identity(self, problem: P) -> tuple[Any, ...]:
        """What besides the problem makes this family's best config differ (a library
        version, an operand layout): part of the tuning database key."""
        return ()

    def tuning_key(self, problem: P, profile: GpuProfile,
                   identities: tuple[Any, ...]) -> tuple[Any, ...]:
        """The tuning database's problem key of a segment (the first family of the
        segment's kind answers for all, ``identities`` holding every one's
        :meth:`identity`): everything that changes the best config and is not a
        parameter."""
        raise NotImplementedError(f"kernel family {self.name} has no tuning key")

    # -- what the segment kind computes (shared by the families of one kind) -----
    def widths(self, seg: SegmentView) -> tuple[int, int]:
        """(width of the segment's input ``x``, width of its output), tokens being rows."""
        raise NotImplementedError(f"kernel family {self.name} has no row widths")

    def reference(self, seg: SegmentView, act: Any, param: Any, kn: Any,
                  extra: dict[str, Any]) -> tuple[Any, Any]:
        """``(out, pre_norm)`` of the segment in float64 from its bindings
        (:func:`stofc.plan.reference.reference_segment` supplies the callables)."""
        raise ValueError(f"no reference for segment kind {seg.family!r}")

    # -- the CUDA twins (the ORT library's ops running this family's segments) ----
    def twin_epilogue_config(self, spec: KernelSpec) -> Any | None:
        """The Add+Norm config a CUDA twin's epilogue kernel takes for this segment (a
        tuned one), or None for the Add+Norm family's default."""
        return None

    def twin_lt_rank(self, spec: KernelSpec) -> tuple[int, int] | None:
        """``(M, rank)``: the cuBLASLt heuristic rank a FusedGemm twin uses at M, when this
        family's spec carries a tuned one."""
        return None

    # -- kernels -----------------------------------------------------------------
    @abstractmethod
    def kernels(self, problem: P, config: C) -> tuple[KernelInstance, ...]:
        """The kernels one run of ``config`` launches, main first."""

    @abstractmethod
    def render(self, kernel: KernelInstance) -> Source:
        """The CUDA source of one of this family's kernels."""

    def nvrtc_target(self, kernel: KernelInstance, target: str) -> str:
        """The NVRTC target ``kernel`` compiles for when the package targets ``target``."""
        return target


_FAMILIES: dict[str, KernelFamily[Any, Any]] = {}
_BY_TEMPLATE: dict[tuple[str, str], str] = {}

F = TypeVar("F", bound=type)


def register(cls: F) -> F:
    """Class decorator: register one instance of a :class:`KernelFamily` subclass.

    Raises :class:`RegistryError` for a name already taken or a (segment, template)
    pair another family owns: two modules must never silently replace each other.
    """
    family = cls()
    if family.name in _FAMILIES:
        raise RegistryError(f"kernel family {family.name!r} is registered twice "
                            f"({type(_FAMILIES[family.name]).__module__} and {cls.__module__})")
    pairs = [(seg, tpl) for seg in family.segments for tpl in family.templates]
    for pair in pairs:
        if pair in _BY_TEMPLATE:
            raise RegistryError(f"kernel family {family.name!r} claims segment {pair[0]!r} "
                                f"with template {pair[1]!r}, which {_BY_TEMPLATE[pair]!r} owns")
    _FAMILIES[family.name] = family
    _BY_TEMPLATE.update(dict.fromkeys(pairs, family.name))
    return cls


def family(name: str) -> KernelFamily[Any, Any]:
    """The family registered as ``name``."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise PlanError(f"no kernel family {name!r} is registered",
                        hint=f"known families: {', '.join(sorted(_FAMILIES))}") from None


def families() -> tuple[KernelFamily[Any, Any], ...]:
    """Every registered family, by name."""
    return tuple(_FAMILIES[n] for n in sorted(_FAMILIES))


def families_for(segment: str, *, vendor: bool = True) -> tuple[KernelFamily[Any, Any], ...]:
    """The families executing segment kind ``segment``, by preference (``vendor=False``:
    hand-written kernels only)."""
    found = [f for f in _FAMILIES.values() if segment in f.segments and (vendor or not f.vendor)]
    return tuple(sorted(found, key=lambda f: (f.preference, f.name)))


def family_of(spec: KernelSpec) -> KernelFamily[Any, Any]:
    """The family that wrote ``spec`` (by its segment kind and template)."""
    name = _BY_TEMPLATE.get((spec.family, spec.template))
    if name is None:
        raise PlanError(f"no kernel family runs {spec.family!r} segments with template "
                        f"{spec.template!r}", hint="recompile the model with this stofc version")
    return _FAMILIES[name]


def family_of_params(segment: str, params: Mapping[str, Any]) -> KernelFamily[Any, Any]:
    """The family a tuner config of a ``segment`` space belongs to (its tag)."""
    for fam in families_for(segment):
        if fam.owns(params):
            return fam
    raise PlanError(f"no {segment} kernel family owns the tuner config {dict(params)}",
                    hint="this is a stofc bug; report it")


def default_kernel(seg: SegmentView, ctx: PlanContext, *, vendor: bool = True) -> KernelSpec:
    """The analytical default KernelSpec of ``seg``: the first family (by preference) that
    runs its problem and has a default config. Raises PlanError saying why none does."""
    reasons = []
    profile = ctx.profile
    if profile is None:
        raise PlanError("no GPU profile to choose a kernel for", hint="this is a stofc bug")
    peers = families_for(seg.family, vendor=vendor)
    if peers:
        chosen = peers[0].choose(peers, seg, ctx)
        if chosen is not None:
            return chosen
    for fam in peers:
        problem = fam.problem(seg, ctx)
        why = fam.unsupported(problem, profile)
        if why is None:
            config = fam.default(problem, profile)
            if config is not None:
                return fam.spec(problem, config)
            why = "no configuration fits"
        reasons.append(f"{fam.name}: {why}")
    raise PlanError(f"no kernel family runs segment {getattr(seg, 'ordinal', '?')} "
                    f"({seg.family}) ({'; '.join(reasons) or 'none registered'})",
                    hint="choose another fusion scheme")
