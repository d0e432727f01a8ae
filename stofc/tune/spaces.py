"""Segment spaces of the real kernel families and the attention kernels (tuner side).

One :class:`KernelSegment` per segment of a layer chain at one (batch,
sequence length): the family's declared search space after analytical
pruning, its analytical default, the problem key and the payload the GPU
runners (:mod:`stofc.tune.runners`) need. It also turns a config back into
the plan's :class:`~stofc.plan.plan.KernelSpec` (:meth:`KernelSegment.kernel_spec`),
with the same template names and parameter order as
:func:`stofc.plan.build.kernel_spec`, so a tuned plan is read like a default one.

Configs per family (flat JSON-scalar mappings):

* ``gemm`` / ``gemm_norm``: ``{"impl": "cublas", "lt", "tpr", "rows"}`` (the
  vendor path: cuBLAS, then the Add+Norm kernel as the epilogue pass, whose
  threads-per-row and rows-per-block are tuned; ``lt``: through cuBLASLt with
  its epilogue, else plain cuBLAS), with ``"lt_algo"`` when ``lt`` (which of
  cuBLASLt's heuristic candidates runs, see below), or ``{"impl": "mma", "bm",
  "bn", "bk", "warps_m", "warps_n", "stages"}`` (the hand-written template).
  The head-split QKV store has no vendor path.
* ``gemm_gemm``: ``{"bm", "bh", "bk", "warps", "stages", "split"}``.
* ``add_norm``: ``{"tpr", "rows"}``.
* ``attention``: ``{"kind", "tile", "warp_m", "warps", "stages", "q_split",
  "gather"}`` over both kernels (``block`` and ``row``) for the mask's tile.

The cuBLASLt algorithm (``lt_algo``): the rank of the heuristic result used
(``cublasLtMatmulAlgoGetHeuristic`` asked for ``lt_algo + 1`` results; 0 is its
first choice and the analytical default). Ranks 0..``LT_ALGO_RANKS - 1`` (8)
are searched, crossed with the epilogue kernel's configs (the two launches are
independent, but the best pair needs both axes). Pruning: the heuristic sorts
its candidates by its own estimate, so ranks past 8 rarely win and each costs a
measurement per epilogue config; the number actually returned is known only
on the GPU, so a rank it does not return is rejected when measured (a fault,
"rejected: ... returned N algorithm(s)"), never timed as a duplicate of the
last. A tuned rank is valid for one M: the plan's KernelSpec carries
``("lt_algo", rank), ("lt_m", tokens)`` (both only when the rank is not 0, so
untuned specs are unchanged); at any other M the runtimes use rank 0. The
ORT library takes them as ``FusedGemm``'s ``lt_algo_m`` / ``lt_algo_rank``.

Problem keys hold everything that changes the best config and is not a
parameter: the shapes (tokens = batch x length, widths), the dtype, the
epilogue (its tag), the output layout, the GPU architecture, and for attention
the mask format's hash, ``L_max`` and tile; for GEMMs with a vendor path the
cuBLASLt version and operand layout (:func:`vendor_tag`: a rank names an
algorithm only for one library version and one set of descriptors). The
architecture is also the compile option (part of the database key).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stofc.errors import PlanError
from stofc.frontend.types import Layer
from stofc.kernels import gemm as gemm_family
from stofc.kernels import gemm_gemm as gg_family
from stofc.kernels import norm as norm_family
from stofc.kernels.epilogue import Epilogue
from stofc.plan.dataflow import value_widths
from stofc.plan.families import SegmentMatch
from stofc.plan.plan import KernelSpec, Segment
from stofc.targets import GpuProfile
from stofc.tune.interfaces import Config

VENDOR = "vendor/cublas"
LT_ALGO, LT_M = "lt_algo", "lt_m"          # the vendor KernelSpec's tuned-algorithm params
LT_ALGO_RANKS = 8                         # heuristic ranks searched (module doc: pruning)
GEMM_PARAMS = ("bm", "bn", "bk", "warps_m", "warps_n", "stages")
GG_PARAMS = ("bm", "bh", "bk", "warps", "stages", "split")


@dataclass(frozen=True)
class SegmentPayload:
    """What a GPU runner needs for a non-attention segment (pickles to the worker).

    ``segment`` carries the default kernel; the runner swaps in the candidate's
    spec. ``layer`` names the weights and gives the attention shape (head store).
    """

    layer: Layer
    segment: Segment
    batch: int
    seq_len: int
    dtype: str
    arch: str
    l2_bytes: int
    store: str = "row"


@dataclass(frozen=True)
class AttentionPayload:
    """What the attention runner needs: the mask format and the launch shape.

    ``layout``: ``"bshd"`` (Q/K/V slices of a packed ``[B, S, 3, H, D]``
    projection, the plan's ``row`` store) or ``"bhsd"`` (``[3, B, H, S, D]``,
    the ``heads`` store). ``key_bits``: the layer's SparseAttention receives a key
    padding mask, so the kernel variant it deploys tests key bits: the runner
    measures that variant (an all-real-token mask), not the mask-free one.
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


def has_key_padding(block: Any) -> bool:
    """Whether the package's SparseAttention for ``block`` gets a key padding mask.

    The rule of :func:`stofc.package.rewrite.attention_inputs`: a mask form that
    comes from a graph input (not the model's own constant causal mask).
    """
    forms = set(str(getattr(block, "mask_form", "none")).split("+"))
    return bool(forms & {"additive", "boolean_where", "boolean"}) and \
        getattr(block, "mask_source", None) is not None


@dataclass
class KernelSegment:
    """A :class:`~stofc.tune.interfaces.SegmentSpace` over one real kernel family.

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


def _declared(space: Any, prefix: str = "", **extra: Any) -> tuple[list[Config], dict[str, int]]:
    configs = [Config.of(dict(c), **extra) for c in space.configs()]
    reasons = {f"{prefix}{k}": v for k, v in space.explain().items() if k != "valid"}
    return configs, reasons


def _with_ranks(part: tuple[list[Config], dict[str, int]]) -> tuple[list[Config], dict[str, int]]:
    """Each cuBLASLt config once per heuristic rank 0..LT_ALGO_RANKS-1 (module doc)."""
    configs, reasons = part
    return [c.replace(**{LT_ALGO: r}) for c in configs for r in range(LT_ALGO_RANKS)], reasons


def _merge(*parts: tuple[list[Config], dict[str, int]]) -> tuple[list[Config], dict[str, int]]:
    configs: list[Config] = []
    reasons: dict[str, int] = {}
    for cs, rs in parts:
        configs.extend(cs)
        for k, v in rs.items():
            reasons[k] = reasons.get(k, 0) + v
    return configs, reasons


def config_of_spec(spec: KernelSpec, tokens: int | None = None) -> Config:
    """The tuner's config for a plan kernel spec (inverse of ``kernel_spec``).

    ``tokens``: the M the config is for; a vendor spec's ``lt_algo`` tuned at
    another ``lt_m`` does not apply there (rank 0, as at run time).
    """
    if spec.template == VENDOR:
        lt = bool(spec.param("lt", True))
        config = Config.of(impl="cublas", lt=lt, tpr=spec.param("tpr"), rows=spec.param("rows"))
        if not lt:
            return config
        rank = int(spec.param(LT_ALGO, 0) or 0)
        lt_m = spec.param(LT_M)
        if tokens is not None and lt_m is not None and int(lt_m) != tokens:
            rank = 0
        return config.replace(**{LT_ALGO: rank})
    if spec.family in ("gemm", "gemm_norm"):
        return Config.of({k: spec.param(k) for k in GEMM_PARAMS}, impl="mma")
    if spec.family == "gemm_gemm":
        return Config.of({k: spec.param(k) for k in GG_PARAMS})
    if spec.family == "add_norm":
        return Config.of(tpr=spec.param("tpr"), rows=spec.param("rows"))
    if spec.family == "attention":   # fields the spec lacks take the config's defaults
        given = {k: spec.param(k) for k in attention_fields() if spec.param(k) is not None}
        return Config.of(dataclasses.asdict(attention_config(given)))
    raise PlanError(f"no tuner config for kernel family {spec.family!r}",
                    hint="this is a stofc bug; report it")


def attention_fields() -> tuple[str, ...]:
    """The fields of :class:`~stofc.kernels.attention.AttentionConfig` (the config's axes)."""
    from stofc.kernels.attention.config import AttentionConfig

    return tuple(f.name for f in dataclasses.fields(AttentionConfig))


def attention_config(params: Mapping[str, Any]) -> Any:
    """The :class:`~stofc.kernels.attention.AttentionConfig` of a tuner config."""
    from stofc.kernels.attention.config import AttentionConfig

    return AttentionConfig(**{k: params[k] for k in attention_fields() if k in params})


def _attention_space(fmt: Any, kind: str, head_dim: int, dtype: str,
                     profile: GpuProfile) -> list[Any]:
    """``search_space`` for the format: its gather / permutation switches when it has them."""
    from stofc.kernels.attention import search_space

    accepted = inspect.signature(search_space).parameters
    extra: dict[str, bool] = {}
    if "gatherable" in accepted:
        from stofc.kernels.attention.gather import plan_tiles
        extra["gatherable"] = plan_tiles(fmt, gather=True).gathered > 0
    if "permutable" in accepted:
        from stofc.kernels.attention import permute  # type: ignore[attr-defined]
        extra["permutable"] = permute.choose_permutation(fmt) is not None
    return search_space(kind, head_dim, dtype, profile, tile=fmt.tile, **extra)


def spec_of(family: str, config: Config, *, dtype: str, store: str = "row",
            width: int = 0, tokens: int = 0) -> KernelSpec:
    """The plan's kernel spec of a non-attention ``config`` (inverse of :func:`config_of_spec`).

    Template names and parameter order as :func:`stofc.plan.build.kernel_spec`.
    ``store``: the GEMM output layout; ``width``: the row width of ``add_norm``;
    ``tokens``: M, recorded as ``lt_m`` beside a cuBLASLt rank other than 0.
    """
    common: tuple[tuple[str, Any], ...] = (("dtype", dtype),)
    if family in ("gemm", "gemm_norm"):
        common = (*common, ("store", store))
        if config["impl"] == "cublas":
            lt = bool(config["lt"])
            params = (*common, ("lt", lt), ("tpr", config["tpr"]), ("rows", config["rows"]))
            rank = int(config.get(LT_ALGO, 0)) if lt else 0
            if rank:
                if tokens < 1:
                    raise PlanError(f"a cuBLASLt rank ({rank}) needs the M it was tuned at",
                                    hint="this is a stofc bug; pass tokens to spec_of")
                params = (*params, (LT_ALGO, rank), (LT_M, int(tokens)))
            return KernelSpec(family, VENDOR, params)
        return KernelSpec(family, gemm_family.TEMPLATE,
                          (*common, *((p, config[p]) for p in GEMM_PARAMS)))
    if family == "gemm_gemm":
        return KernelSpec(family, gg_family.TEMPLATE,
                          (*common, *((p, config[p]) for p in GG_PARAMS)))
    if family == "add_norm":
        return KernelSpec(family, norm_family.TEMPLATE,
                          (*common, ("n", width), ("tpr", config["tpr"]),
                           ("rows", config["rows"])))
    raise PlanError(f"no kernel family {family!r}", hint="this is a stofc bug; report it")


def vendor_tag() -> str:
    """The vendor path's identity in GEMM problem keys: cuBLASLt version, weight layout and
    what Lt folds (``lt2``: the tanh GELU joined the bias and ReLU; a rank measured with
    the older split timed another epilogue)."""
    from stofc.runtime.segment_cublas import lt_version

    return f"cublasLt:{lt_version() or 'none'}:w_kn:lt2"


def vendor_rest(ep: Epilogue, lt: bool) -> Epilogue:
    """What the vendor path leaves to the Add+Norm kernel after the GEMM.

    cuBLASLt folds the bias, a ReLU or tanh GELU (without a residual after it) and
    (without an activation) the residual
    (:func:`stofc.runtime.segment_cublas.lt_split`); plain cuBLAS folds
    nothing. Same rule as ``SegmentRunner._compile_vendor``; used here only to
    avoid listing epilogue configs for a kernel that never runs.
    """
    if not lt:
        return ep
    from stofc.runtime.segment_cublas import lt_split

    _, act_done = lt_split(ep.bias, ep.act, ep.residual)
    fold_residual = ep.residual and ep.act == "none"
    return Epilogue(bias=False, act="none" if act_done else ep.act,
                    residual=ep.residual and not fold_residual, norm=ep.norm,
                    norm_shift=ep.norm_shift)


def _label(match: SegmentMatch) -> str:
    roles = "+".join(match.roles) or "-"
    ops = f"{match.ops[0]}" if len(match.ops) == 1 else f"{match.ops[0]}-{match.ops[-1]}"
    return f"ops {ops} {match.family} {roles}"


def with_width(layer: Layer, match: SegmentMatch) -> SegmentMatch:
    """``match`` with the row width ``n`` in its dims for memory-bound segments.

    Same rule as :func:`stofc.plan.build.plan_layer` (the dataflow's widths).
    """
    if match.family != "add_norm" or "n" in dict(match.dims):
        return match
    width = value_widths(layer)[match.binding("out") or match.inputs[0]]
    return SegmentMatch(match.ordinal, match.ops, match.family, match.epilogues, match.bindings,
                        (*match.dims, ("n", int(width))), match.epsilon, match.roles,
                        match.inputs, match.outputs)


def _segment(layer: Layer, match: SegmentMatch, spec: KernelSpec) -> Segment:
    return Segment(layer=layer.index, ordinal=match.ordinal, ops=match.ops, family=match.family,
                   epilogues=match.epilogues, bindings=match.bindings, dims=match.dims,
                   epsilon=match.epsilon, roles=match.roles, inputs=match.inputs,
                   outputs=match.outputs, kernel=spec)


@dataclass(frozen=True)
class SpaceFactory:
    """Turns each ``SegmentMatch`` of one layer into its :class:`KernelSegment`.

    ``tokens = batch * seq_len``. ``qkv_store``: the plan's layout of the QKV
    projection (``row`` or ``heads``). ``mask``: the attention mask format
    (encoded for ``L_max >= seq_len``). ``defaults``: kernel specs keyed by
    segment operators, used as the analytical default where they fit (the
    plan's own choices); otherwise :func:`stofc.plan.build.kernel_spec`.
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

    def __call__(self, match: SegmentMatch) -> KernelSegment:
        match = with_width(self.layer, match)
        if match.family in ("gemm", "gemm_norm", "gemm_gemm") and "n0" not in dict(match.dims):
            raise PlanError(f"segment {match.ordinal} (operators {list(match.ops)}) puts "
                            "memory-bound operators before its GEMM; no kernel family has "
                            "such a prologue", hint="choose another fusion scheme")
        if match.family == "attention":
            return self.attention(match)
        if match.family == "ort":
            raise PlanError(f"segment {match.ordinal} (operators {list(match.ops)}) runs in ONNX "
                            "Runtime (no template implements it); the tuner cannot measure it",
                            hint="tune models whose layers have no ONNX Runtime segments")
        if match.family in ("gemm", "gemm_norm"):
            return self.gemm(match)
        if match.family == "gemm_gemm":
            return self.gemm_gemm(match)
        if match.family == "add_norm":
            return self.add_norm(match)
        raise PlanError(f"no kernel family {match.family!r}", hint="this is a stofc bug")

    # -- shared ------------------------------------------------------------------
    def _default_spec(self, match: SegmentMatch, store: str) -> KernelSpec | None:
        from stofc.plan.build import PREFER_VENDOR_GEMM, kernel_spec

        given = dict(self.defaults).get(match.ops)
        if given is not None and given.family == match.family:
            return given
        try:
            return kernel_spec(match, tokens=self.tokens, profile=self.profile, dtype=self.dtype,
                               store=store, vendor=PREFER_VENDOR_GEMM and store == "row")
        except PlanError:
            return None   # e.g. no GEMM+GEMM config fits: the space says so (empty)

    def _make(self, match: SegmentMatch, problem: tuple, to_spec: Any, build: Any,
              store: str) -> KernelSegment:
        spec0 = self._default_spec(match, store)
        default = (config_of_spec(spec0, self.tokens) if spec0 is not None
                   else Config.of(impl="none"))
        seg = _segment(self.layer, match, spec0 or KernelSpec(match.family, "none"))
        payload = SegmentPayload(self.layer, seg, self.batch, self.seq_len, self.dtype,
                                 self.profile.arch, self.profile.l2_bytes, store)
        return KernelSegment(match.family, (*problem, self.profile.arch), (self.profile.arch,),
                             _label(match), payload, default, to_spec, build)

    def _store(self, match: SegmentMatch) -> str:
        return self.qkv_store if set(match.roles) & {"qkv", "q", "k", "v"} else "row"

    # -- families ----------------------------------------------------------------
    def gemm(self, match: SegmentMatch) -> KernelSegment:
        ep, store = match.epilogues[-1], self._store(match)
        n, k = match.dim("n0"), match.dim("k0")
        dtype, profile, family = self.dtype, self.profile, match.family
        problem = gemm_family.GemmProblem(self.tokens, n, k, dtype, ep, store)
        nproblem = norm_family.NormProblem(self.tokens, n, dtype, ep)

        def build() -> tuple[list[Config], dict[str, int]]:
            parts = [_declared(gemm_family.space(problem, profile), "mma: ", impl="mma")]
            if store == "row":
                for lt in (True, False):
                    rest = vendor_rest(ep, lt)
                    if rest.is_identity:   # nothing left for the epilogue kernel to do
                        cfg = norm_family.default_config(nproblem, profile)
                        part = ([Config.of(impl="cublas", lt=lt, tpr=cfg.tpr, rows=cfg.rows)],
                                {})
                    else:
                        rproblem = norm_family.NormProblem(self.tokens, n, dtype, rest)
                        part = _declared(norm_family.space(rproblem, profile),
                                         f"cublas{'Lt' if lt else ''} epilogue: ",
                                         impl="cublas", lt=lt)
                    parts.append(_with_ranks(part) if lt else part)
            return _merge(*parts)

        to_spec = functools.partial(spec_of, family, dtype=dtype, store=store, tokens=self.tokens)
        key = ("tokens", self.tokens, n, k, dtype, ep.tag, store)
        if store == "row":   # the vendor path is in the space: its library and layout
            key = (*key, vendor_tag())
        return self._make(match, key, to_spec, build, store)

    def gemm_gemm(self, match: SegmentMatch) -> KernelSegment:
        problem = gg_family.problem_of(match, self.tokens, self.dtype)
        dtype, profile = self.dtype, self.profile

        def build() -> tuple[list[Config], dict[str, int]]:
            return _declared(gg_family.space(problem, profile))

        to_spec = functools.partial(spec_of, "gemm_gemm", dtype=dtype)
        key = ("tokens", self.tokens, problem.k1, problem.n1, problem.n2, dtype,
               problem.ep1.tag, problem.ep2.tag)
        return self._make(match, key, to_spec, build, "row")

    def add_norm(self, match: SegmentMatch) -> KernelSegment:
        ep: Epilogue = match.epilogues[-1]
        width = match.dim("n")
        nproblem = norm_family.NormProblem(self.tokens, width, self.dtype, ep)
        dtype, profile = self.dtype, self.profile

        def build() -> tuple[list[Config], dict[str, int]]:
            return _declared(norm_family.space(nproblem, profile))

        to_spec = functools.partial(spec_of, "add_norm", dtype=dtype, width=width)
        key = ("tokens", self.tokens, width, dtype, ep.tag)
        return self._make(match, key, to_spec, build, "row")

    def attention(self, match: SegmentMatch) -> KernelSegment:
        from stofc.kernels.attention import render, select_kernel
        from stofc.kernels.attention.config import template_name

        if self.mask is None:
            raise PlanError("tuning the attention segment needs the mask format",
                            hint="pass the mask (a MaskFormat or spec) to tune_plan")
        fmt, block = self.mask, self.layer.attention
        heads, head_dim, dtype, profile = block.num_heads, block.head_dim, self.dtype, self.profile
        seq_len = min(self.seq_len, fmt.seq_len)
        layout = "bhsd" if self.qkv_store == "heads" else "bshd"
        choice = select_kernel(fmt, profile, batch=self.batch, heads=heads, seq_len=seq_len,
                               head_dim=head_dim)
        fields = attention_fields()

        def as_config(c: Any) -> Config:
            return Config.of({p: getattr(c, p) for p in fields})

        def build() -> tuple[list[Config], dict[str, int]]:
            kinds = ("block", "row", "ws") if fmt.tile >= 64 else ("row",)
            configs = [as_config(c) for kind in kinds
                       for c in _attention_space(fmt, kind, head_dim, dtype, profile)]
            reasons = {} if fmt.tile >= 64 else {
                f"block-wise needs T >= 64 (mask tile {fmt.tile})": 1}
            return list(dict.fromkeys(configs)), reasons

        def to_spec(config: Config) -> KernelSpec:
            return KernelSpec("attention", template_name(str(config["kind"]),
                                                         str(config.get("mma", "sync"))),
                              (("dtype", dtype), ("head_dim", head_dim),
                               *((p, config[p]) for p in fields if p in config)))

        key_bits = has_key_padding(block)
        payload = AttentionPayload(fmt, self.batch, seq_len, heads, head_dim, dtype, layout,
                                   float(block.scale or head_dim ** -0.5), profile.arch,
                                   profile.l2_bytes, key_bits)
        given = dict(self.defaults).get(match.ops)
        default = as_config(choice.config)
        if given is not None and given.family == "attention" and given.param("kind"):
            default = config_of_spec(given)
        problem = ("attention", self.batch, seq_len, heads, head_dim, dtype, layout,
                   fmt.spec_hash, fmt.seq_len, fmt.tile, profile.arch,
                   *(("key_bits",) if key_bits else ()))
        return KernelSegment("attention", problem, (*render.COMPILE_OPTIONS, profile.arch),
                             _label(match), payload, default, to_spec, build)
