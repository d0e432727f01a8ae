"""Every layer's attention kernels: the plan's choice, explained, with its run-time variants.

An untuned plan's attention kernel is the selector's
(:func:`stofc.kernels.attention.choose_attention`): the base kernel the plan
records, the explanation, and the variants the chosen family adds for shapes
the base kernel serves badly (block-wise: the query split while the grid is
short of one wave). A tuned plan (or one given to ``recompile_package``) names
a config the tuner measured: it replaces the selector's choice and its
variants, and each shorter sequence-length bucket whose tuned config differs
becomes a variant for ``S <= bucket`` (unless the next one would pick the same
kernel anyway).

An untuned plan compiled with sequence-length buckets (``stofc compile --seq-len``;
:func:`stofc.pipeline.compile_model`) gets the same mechanism from the selector: for
every bucket ``n < max_seq_len`` the selector runs on the layer's mask encoded at
length ``n`` (``length_masks``), and its pick (with that pick's own run-time variants,
capped at ``S <= n``) becomes variants for ``S <= n``; a bucket whose launches equal the
next longer bucket's adds none. Every bucket's pick is recorded (:class:`BucketPick`,
plan.json ``attention[].buckets``), so a package compiled for 32K runs the kernel the
selector picks at 512 when a run is 512 long. A bucket pick's config is made to fit the
package's own (``L_max``) mask format: a residue permutation that the full-length mask
has none for is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from stofc.errors import PlanError
from stofc.frontend.types import ModelGraph
from stofc.kernels import catalog
from stofc.kernels.attention.config import AttentionConfig, attention_family
from stofc.kernels.attention.family import AttentionFamily, AttentionProblem
from stofc.kernels.attention.launch import LaunchData
from stofc.kernels.attention.permute import choose_permutation
from stofc.kernels.attention.select import (
    AttentionVariant,
    KernelChoice,
    choose_attention,
    planned_choice,
)
from stofc.kernels.registry import KernelInstance
from stofc.masks.format import MaskFormat
from stofc.masks.layers import LayerMasks
from stofc.package.layout import launch_plan_file
from stofc.plan.attention import attention_inputs
from stofc.plan.plan import Plan, TunedPlan
from stofc.targets import GpuProfile

# the selector's sequence-length buckets of an untuned package (those below its
# max_seq_len; stofc compile --seq-len replaces them): factors of 4 from 128
DEFAULT_BUCKETS = (128, 512, 2048, 8192, 32768)


def bucket_lengths(seq_lens: tuple[int, ...] | None, max_seq_len: int) -> tuple[int, ...]:
    """The selector's bucket lengths below ``max_seq_len`` (``None``: the defaults);
    a given length outside ``1..max_seq_len`` is a PlanError."""
    if seq_lens is None:
        return tuple(n for n in DEFAULT_BUCKETS if n < max_seq_len)
    bad = [n for n in seq_lens if not 1 <= n <= max_seq_len]
    if bad:
        raise PlanError(f"--seq-len {bad[0]} is outside 1..{max_seq_len} (the package's "
                        "max_seq_len)", hint="give bucket lengths up to --max-seq-len")
    return tuple(sorted({n for n in seq_lens if n < max_seq_len}))


@dataclass(frozen=True)
class BucketPick:
    """The selector's pick for runs up to ``seq_len`` (the mask encoded at that length):
    its choice and run-time variants; ``launched``: whether they became the node's
    variants (False: the next longer bucket launches the same kernels)."""

    seq_len: int
    choice: KernelChoice
    variants: tuple[AttentionVariant, ...]
    launched: bool


@dataclass(frozen=True)
class AttentionKernel:
    """One layer's attention: the problem, the base kernel's choice and the run-time
    variants (tried first, in order), the node's other inputs' value names, and the
    selector's per-length picks (untuned packages compiled with buckets)."""

    layer: int
    problem: AttentionProblem
    choice: KernelChoice
    variants: tuple[AttentionVariant, ...] = ()
    key_padding_mask: str | None = None
    bias: str | None = None
    buckets: tuple[BucketPick, ...] = ()

    def family(self, choice: KernelChoice | None = None) -> AttentionFamily:
        return attention_family((choice or self.choice).kernel)

    def instance(self, choice: KernelChoice) -> KernelInstance:
        """The main kernel of ``choice`` (its family's first)."""
        return self.family(choice).kernels(self.problem, choice.config)[0]

    def instances(self) -> tuple[KernelInstance, ...]:
        """Every kernel: the base's, then each variant's."""
        return tuple(k for c in (self.choice, *(v.choice for v in self.variants))
                     for k in self.family(c).kernels(self.problem, c.config))

    def launch(self, choice: KernelChoice) -> tuple[tuple[str, int], ...]:
        """The launch attributes of ``choice``'s kernel (OPS.md)."""
        return self.family(choice).launch(choice.config, self.problem.head_dim)

    def launch_plan_file(self, choice: KernelChoice) -> str:
        """The package file holding ``choice``'s launch data (one per launch key and mask)."""
        return launch_plan_file(self.problem.fmt, self.family(choice).launch_key(choice.config))

    def launch_data(self, choice: KernelChoice) -> LaunchData:
        """What ``choice``'s kernel is launched with (the runtime's and the CUDA twin's)."""
        return self.family(choice).launch_data(self.problem.fmt, choice.config)


def _plan_config(plan: Plan, layer: int) -> AttentionConfig | None:
    """The attention config the plan's attention segment of ``layer`` names, if any."""
    for lp in plan.layers:
        for seg in lp.segments:
            if lp.index != layer:
                continue
            try:
                fam = catalog.family_of(seg.kernel)
            except PlanError:
                continue
            if isinstance(fam, AttentionFamily):
                return fam.config_of(seg.kernel, None)
    return None


def _with_plan(choice: KernelChoice, planned: AttentionConfig, max_seq_len: int,
               buckets: tuple[tuple[int, AttentionConfig | None], ...]
               ) -> tuple[KernelChoice, tuple[AttentionVariant, ...]]:
    """The planned config as the base kernel and the shorter buckets' as variants (module
    doc)."""
    chain = [(length, bcfg) for length, bcfg in sorted(buckets, key=lambda b: b[0])
             if bcfg is not None and length < max_seq_len]
    kept: list[tuple[int, AttentionConfig]] = []
    following = planned
    for length, bcfg in reversed(chain):
        if bcfg != following:
            kept.insert(0, (length, bcfg))
            following = bcfg
    variants = tuple(AttentionVariant(length, 0, replace(choice, kernel=c.kind, config=c),
                                      f"tuned for S <= {length}") for length, c in kept)
    if planned == choice.config and not variants:
        return choice, ()
    return planned_choice(choice, planned), variants


def _fit(choice: KernelChoice, fmt: MaskFormat, permutable: dict[str, bool]) -> KernelChoice:
    """``choice`` (made on a shorter encoding of the mask) runnable on the package's
    ``fmt``: without a residue permutation where ``fmt`` has none."""
    if not choice.config.permute:
        return choice
    if fmt.spec_hash not in permutable:
        permutable[fmt.spec_hash] = choose_permutation(fmt) is not None
    if permutable[fmt.spec_hash]:
        return choice
    return replace(choice, config=replace(choice.config, permute=False))


def _launches(choice: KernelChoice, variants: tuple[AttentionVariant, ...]) -> tuple:
    """What a bucket launches, bounds by length aside (the duplicate test)."""
    return (choice.config, tuple((v.choice.config, v.max_batch_rows) for v in variants))


def _selector_buckets(problem: AttentionProblem, profile: GpuProfile, max_seq_len: int,
                      choice: KernelChoice, variants: tuple[AttentionVariant, ...],
                      formats: tuple[tuple[int, MaskFormat], ...]
                      ) -> tuple[tuple[AttentionVariant, ...], tuple[BucketPick, ...]]:
    """The node's variants with the selector's bucket picks in front (module doc), and
    every bucket's pick."""
    permutable: dict[str, bool] = {}
    picks = []
    for n, fmt in sorted(formats, key=lambda f: f[0]):
        if n >= max_seq_len:
            continue
        c, vs = choose_attention(fmt, profile, batch=problem.batch, heads=problem.heads,
                                 seq_len=n, head_dim=problem.head_dim, extras=problem.extras)
        c = _fit(c, problem.fmt, permutable)
        vs = tuple(replace(v, max_seq_len=min(v.max_seq_len or n, n),
                           choice=_fit(v.choice, problem.fmt, permutable),
                           reason=f"selector at S <= {n}: {v.reason}") for v in vs)
        picks.append((n, c, vs))
    following = _launches(choice, variants)
    kept: list[BucketPick] = []
    for n, c, vs in reversed(picks):
        launched = _launches(c, vs) != following
        kept.insert(0, BucketPick(n, c, vs, launched))
        if launched:
            following = _launches(c, vs)
    front: list[AttentionVariant] = []
    for pick in kept:
        if pick.launched:
            front += [*pick.variants,
                      AttentionVariant(pick.seq_len, 0, pick.choice,
                                       f"selector at S <= {pick.seq_len}: "
                                       f"{pick.choice.explanation}")]
    return (*front, *variants), tuple(kept)


def attention_kernel(problem: AttentionProblem, profile: GpuProfile, *, layer: int = 0,
                     max_seq_len: int, planned: AttentionConfig | None = None,
                     buckets: tuple[tuple[int, AttentionConfig | None], ...] = (),
                     key_padding_mask: str | None = None,
                     bias: str | None = None,
                     length_formats: tuple[tuple[int, MaskFormat], ...] = ()
                     ) -> AttentionKernel:
    """One layer's :class:`AttentionKernel` (see the module doc): the selector's choice on
    ``problem`` (its shape and its node's extra inputs) for runs up to ``max_seq_len`` and
    its variants, unless a plan names a config (``planned``; ``buckets``: ``(length,
    config)`` of the tuned buckets); ``length_formats``: ``(length, format)`` of the
    selector's buckets (untuned only)."""
    choice, variants = choose_attention(problem.fmt, profile, batch=problem.batch,
                                        heads=problem.heads, seq_len=max_seq_len,
                                        head_dim=problem.head_dim, extras=problem.extras)
    picks: tuple[BucketPick, ...] = ()
    if planned is not None:
        choice, variants = _with_plan(choice, planned, max_seq_len, buckets)
    elif length_formats:
        variants, picks = _selector_buckets(problem, profile, max_seq_len, choice, variants,
                                            length_formats)
    return AttentionKernel(layer, problem, choice, variants, key_padding_mask, bias, picks)


def attention_kernels(graph: ModelGraph, tuned_plan: TunedPlan, masks: LayerMasks,
                      profile: GpuProfile,
                      length_masks: Mapping[int, LayerMasks] | None = None
                      ) -> dict[int, AttentionKernel]:
    """Every layer's :class:`AttentionKernel`, by layer index (a tuned plan's configs
    replace the selector's; ``length_masks``: the masks encoded at each selector bucket
    length, used by an untuned plan)."""
    plan = tuned_plan.plan
    batch = max(1, plan.tokens // max(1, plan.max_seq_len))
    out = {}
    for layer in graph.layers:
        block, fmt = layer.attention, masks[layer.index]
        kpm, bias = attention_inputs(block, graph.inputs)
        problem = AttentionProblem(fmt, batch, block.num_heads, block.head_dim,
                                   min(plan.max_seq_len, fmt.seq_len), plan.dtype,
                                   has_bias=bias is not None, has_key_bits=kpm is not None,
                                   scale=float(block.scale or block.head_dim ** -0.5),
                                   has_softcap=float(block.softcap or 0.0) > 0.0)
        planned = _plan_config(plan, layer.index) if tuned_plan.tuned else None
        buckets = tuple((n, _plan_config(p, layer.index)) for n, p in tuned_plan.buckets)
        formats = tuple((n, m[layer.index]) for n, m in sorted((length_masks or {}).items()))
        out[layer.index] = attention_kernel(problem, profile, layer=layer.index,
                                            max_seq_len=plan.max_seq_len, planned=planned,
                                            buckets=buckets, key_padding_mask=kpm, bias=bias,
                                            length_formats=formats)
    return out
