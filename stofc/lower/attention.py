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
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from stofc.errors import PlanError
from stofc.frontend.types import ModelGraph
from stofc.kernels import catalog
from stofc.kernels.attention.config import AttentionConfig, attention_family
from stofc.kernels.attention.family import AttentionFamily, AttentionProblem
from stofc.kernels.attention.launch import LaunchData
from stofc.kernels.attention.select import (
    AttentionVariant,
    KernelChoice,
    choose_attention,
    planned_choice,
)
from stofc.kernels.registry import KernelInstance
from stofc.masks.layers import LayerMasks
from stofc.package.layout import launch_plan_file
from stofc.plan.attention import attention_inputs
from stofc.plan.plan import Plan, TunedPlan
from stofc.targets import GpuProfile


@dataclass(frozen=True)
class AttentionKernel:
    """One layer's attention: the problem, the base kernel's choice and the run-time
    variants (tried first, in order), and the node's other inputs' value names."""

    layer: int
    problem: AttentionProblem
    choice: KernelChoice
    variants: tuple[AttentionVariant, ...] = ()
    key_padding_mask: str | None = None
    bias: str | None = None

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


def attention_kernel(problem: AttentionProblem, profile: GpuProfile, *, layer: int = 0,
                     max_seq_len: int, planned: AttentionConfig | None = None,
                     buckets: tuple[tuple[int, AttentionConfig | None], ...] = (),
                     key_padding_mask: str | None = None,
                     bias: str | None = None) -> AttentionKernel:
    """One layer's :class:`AttentionKernel` (see the module doc): the selector's choice on
    ``problem`` for runs up to ``max_seq_len`` and its variants, unless a plan names a
    config (``planned``; ``buckets``: ``(length, config)`` of the tuned buckets)."""
    choice, variants = choose_attention(problem.fmt, profile, batch=problem.batch,
                                        heads=problem.heads, seq_len=max_seq_len,
                                        head_dim=problem.head_dim)
    if planned is not None:
        choice, variants = _with_plan(choice, planned, max_seq_len, buckets)
    return AttentionKernel(layer, problem, choice, variants, key_padding_mask, bias)


def attention_kernels(graph: ModelGraph, tuned_plan: TunedPlan, masks: LayerMasks,
                      profile: GpuProfile) -> dict[int, AttentionKernel]:
    """Every layer's :class:`AttentionKernel`, by layer index (a tuned plan's configs
    replace the selector's)."""
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
        out[layer.index] = attention_kernel(problem, profile, layer=layer.index,
                                            max_seq_len=plan.max_seq_len, planned=planned,
                                            buckets=buckets, key_padding_mask=kpm, bias=bias)
    return out
