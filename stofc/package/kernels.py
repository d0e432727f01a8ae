"""Render and compile every kernel a plan needs: the pipeline's ``render`` and ``compile`` stages.

Contract:

* :func:`render_segment` gives the CUDA sources of one non-attention segment,
  rendered exactly as the segment runner (:mod:`stofc.runtime.segments`) renders
  them: ``gemm``/``gemm_norm`` -> the GEMM template (or, on the vendor path
  ``vendor/cublas``, the Add+Norm epilogue kernel that follows cuBLAS);
  ``gemm_gemm`` -> the GEMM+GEMM template, plus its fp32 Add+Norm finisher when
  the partial sums go through the workspace; ``add_norm`` -> the Add+Norm
  template. The first source is the segment's *main* kernel (the one the
  ai.stofc node names in its ``kernel`` attribute).
* :func:`attention_kernel` picks the attention kernel of one layer for its mask
  format (:func:`stofc.kernels.attention.select_kernel`) and renders the
  template variant for the inputs the SparseAttention node will receive
  (``has_bias``, ``has_key_bits``).
* :func:`compile_all` compiles every distinct source for each target (cubin
  ``sm_XY`` and PTX ``compute_XY``) through NVRTC, in parallel threads; results
  come from the content-addressed cache when present. No GPU is touched.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from stofc.codegen import Source
from stofc.compile import CompiledKernel, compile_source
from stofc.errors import PlanError
from stofc.kernels import gemm as gemm_family
from stofc.kernels import gemm_gemm as gg_family
from stofc.kernels import norm as norm_family
from stofc.kernels.attention import KernelChoice, render_kernel, select_kernel
from stofc.kernels.attention import KernelSpec as AttentionKernelSpec
from stofc.kernels.attention.config import kernel_target, template_name
from stofc.kernels.attention.render import COMPILE_OPTIONS as ATTENTION_OPTIONS
from stofc.kernels.attention.select import block_config, split_limit
from stofc.masks.format import MaskFormat
from stofc.plan.plan import Segment
from stofc.targets import GpuProfile

TOKENS_HINT = 4096  # GEMM/norm problems carry M only as a hint; the kernels take M at run time


@dataclass(frozen=True)
class AttentionVariant:
    """A kernel the layer's SparseAttention node switches to at run time (OPS.md, variants).

    Eligible when the run's ``S <= max_seq_len`` and ``B * ceil(S / T) <= max_batch_rows``
    (0 = no bound); the node takes its first eligible variant, else the base kernel.
    """

    max_seq_len: int
    max_batch_rows: int
    choice: KernelChoice
    spec: AttentionKernelSpec
    source: Source
    reason: str


@dataclass(frozen=True)
class AttentionKernel:
    """One layer's attention kernel: the selector's choice and the rendered variant.

    ``variants``: kernels chosen at run time before this one (see
    :class:`AttentionVariant`); the base kernel serves every shape none of them takes.
    """

    layer: int
    choice: KernelChoice
    spec: AttentionKernelSpec
    source: Source
    variants: tuple[AttentionVariant, ...] = ()

    @property
    def sources(self) -> tuple[Source, ...]:
        """The base source, then each variant's."""
        return (self.source, *(v.source for v in self.variants))


def render_segment(seg: Segment, dtype: str) -> tuple[Source, ...]:
    """The sources of a non-attention segment, main kernel first (see the module doc)."""
    spec, ep = seg.kernel, seg.epilogues[-1]
    if spec.template == "vendor/cublas" or seg.family == "add_norm":
        width = seg.dim("n0") if spec.template == "vendor/cublas" else seg.dim("n")
        ncfg = norm_family.NormConfig(spec.param("tpr"), spec.param("rows"))
        return (norm_family.render_norm(norm_family.NormProblem(TOKENS_HINT, width, dtype, ep),
                                        ncfg),)
    if seg.family in ("gemm", "gemm_norm"):
        cfg = gemm_family.GemmConfig(*(spec.param(k) for k in
                                       ("bm", "bn", "bk", "warps_m", "warps_n", "stages")))
        problem = gemm_family.GemmProblem(TOKENS_HINT, seg.dim("n0"), seg.dim("k0"), dtype, ep,
                                          spec.param("store", "row"))
        return (gemm_family.render_gemm(problem, cfg),)
    if seg.family == "gemm_gemm":
        cfg2 = gg_family.GemmGemmConfig(spec.param("bm"), spec.param("bh"), spec.param("bk"),
                                        spec.param("warps"), spec.param("stages"),
                                        split=spec.param("split", 1))
        problem2 = gg_family.GemmGemmProblem(TOKENS_HINT, seg.dim("k0"), seg.dim("n0"),
                                             seg.dim("n1"), dtype, seg.epilogues[0],
                                             seg.epilogues[1])
        sources = [gg_family.render_gemm_gemm(problem2, cfg2)]
        if cfg2.to_workspace(problem2):
            nprob = norm_family.NormProblem(TOKENS_HINT, problem2.n2, dtype, problem2.ep2,
                                            input_fp32=True)
            sources.append(norm_family.render_norm(nprob, norm_family.default_config(
                nprob, None)))  # type: ignore[arg-type]  # the norm default ignores the GPU
        return tuple(sources)
    raise PlanError(f"segment {seg.ordinal} of layer {seg.layer} has family {seg.family!r}, "
                    "which has no kernel template", hint="this is a stofc bug; report it")


def attention_kernel(layer: int, fmt: MaskFormat, profile: GpuProfile, *, num_heads: int,
                     head_dim: int, dtype: str, batch: int, seq_len: int, has_bias: bool,
                     has_key_bits: bool, has_softcap: bool = False) -> AttentionKernel:
    """The selector's kernel for this layer's mask, rendered for the node's inputs.

    A block-wise choice is made grid-independent: the base kernel is the unsplit
    config (right once the grid fills the GPU) and, when the query split can pay
    on this GPU, a split variant takes the runs with ``B * ceil(S/T) <=``
    :func:`~stofc.kernels.attention.select.split_limit` (the selector's own rule,
    applied at run time with the actual batch and length instead of ``batch``).
    """
    choice = select_kernel(fmt, profile, batch=batch, heads=num_heads, seq_len=seq_len,
                           head_dim=head_dim)
    variants: tuple[AttentionVariant, ...] = ()
    if choice.kernel == "block":
        limit = split_limit(fmt, profile, heads=num_heads, head_dim=head_dim)
        whole = block_config(fmt, profile, batch=batch, heads=num_heads, head_dim=head_dim,
                             q_split=1)
        split = block_config(fmt, profile, batch=batch, heads=num_heads, head_dim=head_dim,
                             q_split=2)
        if limit > 0 and whole is not None and split is not None:
            why = (f"query split while batch x tile rows <= {limit} (the grid is short of one "
                   f"wave of {profile.sm_count}-SM resident blocks at {num_heads} heads)")
            said = choice.explanation.replace(choice.config.describe(), whole.describe())
            base = replace(choice, config=whole,
                           explanation=f"{said}; at run time: {why}, with the split variant "
                                       f"({split.describe()})")
            sspec = AttentionKernelSpec(split, dtype, head_dim, has_bias=has_bias,
                                        has_key_bits=has_key_bits,
                                        has_softcap=has_softcap)
            variants = (AttentionVariant(0, limit, replace(choice, config=split), sspec,
                                         render_kernel(sspec), why),)
            choice = base
    spec = AttentionKernelSpec(choice.config, dtype, head_dim, has_bias=has_bias,
                               has_key_bits=has_key_bits, has_softcap=has_softcap)
    return AttentionKernel(layer, choice, spec, render_kernel(spec), variants)


def compile_options(source: Source) -> tuple[str, ...]:
    """The NVRTC options a source is compiled with (attention kernels add ``-lineinfo``)."""
    return ATTENTION_OPTIONS if source.template.startswith("attention/") else ()


def source_target(source: Source, target: str) -> str:
    """The NVRTC target ``source`` compiles for when the package targets ``target``.

    A wgmma attention kernel and the warp-specialised one (wgmma, setmaxnreg, TMA) need
    the arch-specific ``sm_90a`` / ``compute_90a``; their files keep the package target's
    name (``NAME.sm_90.cubin``: the binary for sm_90 GPUs), and the kernel entry in
    plan.json records the real target.
    """
    wgmma = source.template in (template_name("block", "wgmma"), template_name("ws"))
    return kernel_target("wgmma" if wgmma else "sync", target)


def compile_all(sources: list[Source], targets: tuple[str, ...], *,
                workers: int | None = None) -> dict[tuple[str, str], CompiledKernel]:
    """Compile each distinct source (by name) for each target; ``{(name, target): kernel}``.

    Raises :class:`~stofc.errors.CompileError` (NVRTC's log and the dumped
    source) for the first source that fails.
    """
    unique = {s.name: s for s in sources}
    jobs = [(s, t) for s in unique.values() for t in targets]
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        done = list(pool.map(lambda job: compile_source(job[0], source_target(*job),
                                                        options=compile_options(job[0])), jobs))
    return {(s.name, t): k for (s, t), k in zip(jobs, done, strict=True)}
