"""Segment spaces of the registered kernel families (tuner side).

One :class:`KernelSegment` per segment of a layer chain at one (batch, sequence
length): the union of the search spaces of every family that executes the
segment's kind (:func:`stofc.kernels.catalog.families_for`: the GEMM template
and the vendor cuBLAS(Lt) path for ``gemm`` / ``gemm_norm``, block-wise and
row-wise for ``attention``...), each after its analytical pruning, in the
families' ``space_order``; the analytical default (the plan's own spec where it
has one, else the default a plan would choose); the problem key; and the
payload the GPU runners (:mod:`stofc.tune.runners`) need. A config is a flat
JSON-scalar mapping, tagged so the family it belongs to is known
(:meth:`~stofc.kernels.registry.KernelFamily.params`: ``impl`` ``mma`` /
``cublas`` for GEMMs, ``kind`` for attention); :meth:`KernelSegment.kernel_spec`
turns it into the plan's KernelSpec through that family, exactly as the planner
writes it, so a tuned plan is read like a default one.

Problem keys hold everything that changes the best config and is not a
parameter (:meth:`~stofc.kernels.registry.KernelFamily.tuning_key`): the shapes
(tokens = batch x length, widths), the dtype, the epilogue (its tag), the output
layout, the GPU architecture, and for attention the mask format's hash, ``L_max``
and tile; plus each participating family's identity (the vendor path's cuBLASLt
version and operand layout: a rank names an algorithm only for one library
version and one set of descriptors). The architecture is also the compile option
(part of the database key).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stofc.errors import PlanError
from stofc.frontend.types import Layer
from stofc.kernels import catalog
from stofc.kernels.attention.family import AttentionProblem
from stofc.kernels.registry import KernelFamily, PlanContext
from stofc.kernels.vendor_gemm import LT_ALGO
from stofc.plan.build import PREFER_VENDOR_GEMM, segment_context, with_width
from stofc.plan.families import SegmentMatch
from stofc.plan.plan import KernelSpec, Segment
from stofc.targets import GpuProfile
from stofc.tune.interfaces import Config

__all__ = ["LT_ALGO", "AttentionPayload", "KernelSegment", "SegmentPayload", "SpaceFactory",
           "config_of_spec"]


@dataclass(frozen=True)
class SegmentPayload:
    """What a GPU runner needs for a non-attention segment (pickles to the worker).

    ``segment`` carries the default kernel; the runner swaps in the candidate's spec
    (``problems``: each family's problem, to write it). ``layer`` names the weights
    and gives the attention shape (head store).
    """

    layer: Layer
    segment: Segment
    batch: int
    seq_len: int
    dtype: str
    arch: str
    l2_bytes: int
    store: str = "row"
    problems: tuple[tuple[str, Any], ...] = ()

    def candidate_spec(self, params: Mapping[str, Any]) -> KernelSpec:
        """The plan's KernelSpec of a tuner config (through the family it belongs to)."""
        fam = catalog.family_of_params(self.segment.family, params)
        return fam.spec(dict(self.problems)[fam.name], fam.from_params(params))


@dataclass(frozen=True)
class AttentionPayload:
    """What the attention runner needs: the mask format and the launch shape.

    ``layout``: ``"bshd"`` (Q/K/V slices of a packed ``[B, S, 3, H, D]``
    projection, the plan's ``row`` store) or ``"bhsd"`` (``[3, B, H, S, D]``,
    the ``heads`` store). ``key_bits``: the layer's SparseAttention receives a key
    padding mask, so the kernel variant it deploys tests key bits: the runner
    measures that variant (an all-real-token mask), not the mask-free one. ``bias`` /
    ``softcap``: the node adds a score bias / soft-caps the scores, and the runner
    measures and verifies that variant too (a random ``[1, H, S, S]`` bias; a cap).
    """

    fmt: Any                    # stofc.masks.MaskFormat (numpy arrays; pickles)
    batch: int
    seq_len: int
    heads: int
    head_dim: int
    dtype: str
    layout: str
    scale: float
    arch: str
    l2_bytes: int
    key_bits: bool = False
    bias: bool = False
    softcap: bool = False

    @classmethod
    def of(cls, problem: AttentionProblem, profile: GpuProfile) -> AttentionPayload:
        p = problem
        return cls(p.fmt, p.batch, p.seq_len, p.heads, p.head_dim, p.dtype, p.layout, p.scale,
                   profile.arch, profile.l2_bytes, p.has_key_bits, p.has_bias, p.has_softcap)


@dataclass
class KernelSegment:
    """A :class:`~stofc.tune.interfaces.SegmentSpace` over the families of one segment.

    ``candidates`` is computed lazily by ``build`` (a list of configs and the
    prune reasons); ``default`` must be one of them when any exist.
    ``unordered``: parameters without a scale (stage 2 treats every other value
    as a neighbour): the cuBLASLt rank.
    """

    unordered = (LT_ALGO,)

    family: str
    problem: tuple
    compile_options: tuple[str, ...]
    label: str
    payload: Any
    default: Config
    to_spec: Any                      # Config -> KernelSpec
    build: Any                        # () -> (list[Config], dict[str, int])
    _cache: tuple[list[Config], dict[str, int]] | None = field(default=None, repr=False)

    def _built(self) -> tuple[list[Config], dict[str, int]]:
        if self._cache is None:
            configs, reasons = self.build()
            if configs and self.default not in configs:
                self.default = configs[0]   # the analytical default was pruned here
            self._cache = (configs, reasons)
        return self._cache

    def configs(self) -> Sequence[Config]:
        return self._built()[0]

    def default_config(self) -> Config:
        self._built()
        return self.default

    def prune_reasons(self) -> Mapping[str, int]:
        return self._built()[1]

    def kernel_spec(self, config: Config) -> KernelSpec:
        """The plan's kernel spec for ``config`` (what a tuned plan stores)."""
        return self.to_spec(config)


def config_of_spec(spec: KernelSpec, tokens: int | None = None) -> Config:
    """The tuner's config for a plan kernel spec (inverse of ``kernel_spec``).

    ``tokens``: the M the config is for; a vendor spec's ``lt_algo`` tuned at
    another ``lt_m`` does not apply there (rank 0, as at run time).
    """
    fam = catalog.family_of(spec)
    problem = _M(tokens) if tokens is not None else None
    return Config.of(fam.params(fam.config_of(spec, problem)))


@dataclass(frozen=True)
class _M:
    """A problem that says only its M (what reading a spec's tuned rank needs)."""

    m: int


def _label(match: SegmentMatch) -> str:
    roles = "+".join(match.roles) or "-"
    ops = f"{match.ops[0]}" if len(match.ops) == 1 else f"{match.ops[0]}-{match.ops[-1]}"
    return f"ops {ops} {match.family} {roles}"


def _segment(layer: Layer, match: SegmentMatch, spec: KernelSpec) -> Segment:
    return Segment(layer=layer.index, ordinal=match.ordinal, ops=match.ops, family=match.family,
                   epilogues=match.epilogues, bindings=match.bindings, dims=match.dims,
                   epsilon=match.epsilon, roles=match.roles, inputs=match.inputs,
                   outputs=match.outputs, kernel=spec)


def _merged(families: list[tuple[KernelFamily[Any, Any], Any]], profile: GpuProfile
            ) -> tuple[list[Config], dict[str, int]]:
    """Every family's candidates as tagged tuner configs (first occurrence kept), and the
    reasons summed."""
    configs: dict[Config, None] = {}
    reasons: dict[str, int] = {}
    for fam, problem in families:
        found, why = fam.candidates(problem, profile)
        configs.update(dict.fromkeys(Config.of(fam.params(c)) for c in found))
        for k, v in why.items():
            reasons[k] = reasons.get(k, 0) + v
    return list(configs), reasons


@dataclass(frozen=True)
class SpaceFactory:
    """Turns each ``SegmentMatch`` of one layer into its :class:`KernelSegment`.

    ``tokens = batch * seq_len``. ``qkv_store``: the plan's layout of the QKV
    projection (``row`` or ``heads``). ``mask``: the attention mask format
    (encoded for ``L_max >= seq_len``). ``defaults``: kernel specs keyed by
    segment operators, used as the analytical default where they fit (the
    plan's own choices); otherwise the default a plan would choose for exactly
    this shape.
    """

    layer: Layer
    batch: int
    seq_len: int
    dtype: str
    profile: GpuProfile
    mask: Any = None
    qkv_store: str = "row"
    defaults: tuple[tuple[tuple[int, ...], KernelSpec], ...] = ()

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def context(self, match: SegmentMatch) -> PlanContext:
        """What the families read besides the segment (this shape, for this shape only)."""
        ctx = segment_context(self.layer, match, self.profile, tokens=self.tokens,
                              dtype=self.dtype, fmt=self.mask, batch=self.batch,
                              seq_len=self.seq_len, qkv_store=self.qkv_store)
        return dataclasses.replace(ctx, variants=False)

    def _default_spec(self, match: SegmentMatch, ctx: PlanContext) -> KernelSpec | None:
        given = dict(self.defaults).get(match.ops)
        if given is not None and given.family == match.family:
            try:
                catalog.family_of(given)
                return given
            except PlanError:
                pass       # a spec no family wrote (a plan built without masks): choose
        try:
            return catalog.default_kernel(match, ctx, vendor=PREFER_VENDOR_GEMM)
        except PlanError:
            return None    # e.g. no GEMM+GEMM config fits: the space says so (empty)

    def __call__(self, match: SegmentMatch) -> KernelSegment:
        match = with_width(self.layer, match)
        if any(slot.startswith("w") for slot, _ in match.bindings) and \
                "n0" not in dict(match.dims):
            raise PlanError(f"segment {match.ordinal} (operators {list(match.ops)}) puts "
                            "memory-bound operators before its GEMM; no kernel family has "
                            "such a prologue", hint="choose another fusion scheme")
        peers = catalog.families_for(match.family)
        if not peers:
            raise PlanError(f"no kernel family {match.family!r}", hint="this is a stofc bug")
        if not any(f.tunable for f in peers):
            raise PlanError(f"segment {match.ordinal} (operators {list(match.ops)}) "
                            f"{peers[0].untunable}; the tuner cannot measure it",
                            hint=peers[0].untunable_hint)
        ctx = self.context(match)
        problems = [(fam, fam.problem(match, ctx)) for fam in peers]
        usable = sorted(((f, p) for f, p in problems
                         if f.tunable and f.unsupported(p, self.profile) is None),
                        key=lambda fp: (fp[0].space_order, fp[0].name))
        identities = tuple(x for f, p in usable for x in f.identity(p))
        key = peers[0].tuning_key(problems[0][1], self.profile, identities)
        options = tuple(dict.fromkeys(o for f, _ in usable for o in f.compile_options))
        spec0 = self._default_spec(match, ctx)
        default = (config_of_spec(spec0, self.tokens) if spec0 is not None
                   else Config.of(impl="none"))
        profile, by_name = self.profile, {f.name: p for f, p in problems}

        def build() -> tuple[list[Config], dict[str, int]]:
            return _merged(usable, profile)

        def to_spec(config: Config) -> KernelSpec:
            fam = catalog.family_of_params(match.family, config)
            return fam.spec(by_name[fam.name], fam.from_params(config))

        first = problems[0][1]
        if isinstance(first, AttentionProblem):
            payload: Any = AttentionPayload.of(first, profile)
        else:
            seg = _segment(self.layer, match, spec0 or KernelSpec(match.family, "none"))
            payload = SegmentPayload(self.layer, seg, self.batch, self.seq_len, self.dtype,
                                     profile.arch, profile.l2_bytes, ctx.store,
                                     tuple(by_name.items()))
        return KernelSegment(match.family, key, (*options, profile.arch), _label(match), payload,
                             default, to_spec, build)

