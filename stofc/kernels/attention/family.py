"""The attention kernel families' base: one registered family per kernel form.

An attention family is a :class:`~stofc.kernels.registry.KernelFamily` of the
``attention`` segment kind plus what only attention needs:

* the selector's hooks: a starting config for a mask and shape
  (:meth:`AttentionFamily.starting_config`, None with :meth:`~AttentionFamily.unavailable`
  saying why) and its cost model (:meth:`~AttentionFamily.estimate_us`), compared by
  :func:`stofc.kernels.attention.select.select_kernel`; run-time variants of a choice
  (:meth:`~AttentionFamily.runtime_variants`);
* its pruning, shared memory and register model (:func:`~.config.prune` adds the
  checks every kernel obeys);
* the launch: threads, blocks per tile row and dynamic shared memory
  (:meth:`~AttentionFamily.launch`), and the launch data (:meth:`~AttentionFamily.walk`
  -> :func:`stofc.kernels.attention.launch.assemble`), which the CuPy runtime and the
  package both take from here; the ``*.plan.bin`` file's key and kind code;
* the plan's KernelSpec: ``attention`` / ``attention/<kind>.cu.j2`` with the dtype, the
  config's fields and the two input flags (what plan.json has always stored).

Adding a kernel form (say a warp-specialised Hopper kernel) is one module: a
subclass with its ``kind``, templates, config rules, cost model and launch, decorated
with :func:`~stofc.kernels.registry.register`, imported by :mod:`stofc.kernels.catalog`.
A form whose kernel takes other arguments than ``kernel_abi`` 3 also brings its own
runtime op and CUDA twin; one with a second kernel per launch returns both from
:meth:`~AttentionFamily.kernels`.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from stofc.codegen import Source
from stofc.errors import PlanError
from stofc.kernels.attention.config import AttentionConfig, ExtraInputs, KernelSpec, check_dtype
from stofc.kernels.attention.gather import plan_tiles
from stofc.kernels.attention.launch import AttentionLaunchData, LaunchData, Walk, assemble
from stofc.kernels.attention.permute import choose_permutation
from stofc.kernels.attention.render import COMPILE_OPTIONS, FLAG, common_values, render_kernel
from stofc.kernels.attention.select import (
    AttentionVariant,
    KernelChoice,
    choose_attention,
    select_kernel,
)
from stofc.kernels.registry import KernelFamily, KernelInstance, PlanContext, SegmentView
from stofc.kernels.spec import KernelSpec as PlanKernelSpec
from stofc.masks.format import MaskFormat
from stofc.targets import GpuProfile

# What a plan built without masks records for attention: no kernel chosen (no family
# owns it, so such a plan cannot be rendered; ``stofc inspect`` and kernel tests use it).
NO_ATTENTION_KERNEL = PlanKernelSpec("attention", "attention/select_kernel", (("selected", False),))


@dataclass(frozen=True, eq=False)
class AttentionProblem:
    """One layer's attention as a family sees it: the mask format, the launch shape the
    configs are chosen for, the dtype, and what the SparseAttention node reads besides
    Q, K, V (``has_bias``: an additive score bias; ``has_key_bits``: a key padding mask;
    ``has_softcap``: the scores are soft-capped).
    ``layout``: ``bshd`` (slices of a packed ``[B, S, 3, H, D]`` projection) or ``bhsd``
    (the ``heads`` store); ``scale``: the softmax scale."""

    fmt: MaskFormat
    batch: int
    heads: int
    head_dim: int
    seq_len: int
    dtype: str
    has_bias: bool = False
    has_key_bits: bool = False
    layout: str = "bshd"
    scale: float = 0.0
    has_softcap: bool = False

    @property
    def extras(self) -> ExtraInputs:
        """What the node reads besides Q, K and V (the selector's :class:`.config.ExtraInputs`)."""
        return ExtraInputs(has_bias=self.has_bias, has_key_bits=self.has_key_bits,
                           has_softcap=self.has_softcap)

    def kernel_spec(self, config: AttentionConfig) -> KernelSpec:
        """The rendered-kernel spec of ``config`` for this problem."""
        return KernelSpec(config, self.dtype, self.head_dim, has_bias=self.has_bias,
                          has_key_bits=self.has_key_bits, has_softcap=self.has_softcap)


class AttentionFamily(KernelFamily[AttentionProblem, AttentionConfig]):
    """Base of the attention families (see the module doc)."""

    segments = ("attention",)
    config_type = AttentionConfig
    compile_options = COMPILE_OPTIONS
    kind: ClassVar[str]           # AttentionConfig.kind of this family's configs
    selectable: ClassVar[bool] = True  # the selector offers it (it has a cost model)
    refines: ClassVar[bool] = False    # compared with the selector's pick afterwards
    residue_split: ClassVar[bool] = False   # configs may have period > 1 (.residue)
    launch_data_type: ClassVar[type[LaunchData]] = AttentionLaunchData  # its *.plan.bin data
    label: ClassVar[str]          # "block-wise" ...: how explanations name it
    stof_class: ClassVar[str]     # what STOF's threshold calls such a kernel: block or row
    plan_code: ClassVar[int]      # the ``kind`` field of its *.plan.bin header

    # -- the problem and the plan's spec ---------------------------------------------
    def problem(self, seg: SegmentView, ctx: PlanContext) -> AttentionProblem:
        block, fmt = ctx.attention, ctx.fmt
        if fmt is None:
            raise PlanError("tuning the attention segment needs the mask format",
                            hint="pass the mask (a MaskFormat or spec) to tune_plan")
        return AttentionProblem(
            fmt=fmt, batch=ctx.batch, heads=block.num_heads, head_dim=block.head_dim,
            seq_len=min(ctx.seq_len, fmt.seq_len), dtype=ctx.dtype, has_bias=ctx.bias,
            has_key_bits=ctx.key_padding, layout="bhsd" if ctx.qkv_store == "heads" else "bshd",
            scale=float(block.scale or block.head_dim ** -0.5),
            has_softcap=float(block.softcap or 0.0) > 0.0)

    def choose(self, peers: tuple[KernelFamily[Any, Any], ...], seg: SegmentView,
               ctx: PlanContext) -> PlanKernelSpec:
        """The selector's choice on the layer's format and inputs: the base kernel of
        :func:`.select.choose_attention` (``ctx.variants``), else the config for exactly
        this shape (:func:`.select.select_kernel`); :data:`NO_ATTENTION_KERNEL` without a
        format."""
        if ctx.fmt is None or ctx.profile is None:
            return NO_ATTENTION_KERNEL
        problem = self.problem(seg, ctx)
        shape = {"batch": problem.batch, "heads": problem.heads, "seq_len": problem.seq_len,
                 "head_dim": problem.head_dim}
        if ctx.variants:
            choice, _ = choose_attention(problem.fmt, ctx.profile, **shape, extras=problem.extras)
        else:
            choice = select_kernel(problem.fmt, ctx.profile, **shape, extras=problem.extras)
        fam = next(f for f in peers if f.owns({"kind": choice.kernel}))
        return fam.spec(problem, choice.config)

    def spec(self, problem: AttentionProblem, config: AttentionConfig) -> PlanKernelSpec:
        return PlanKernelSpec("attention", self.templates[0], (
            ("dtype", problem.dtype), *dataclasses.asdict(config).items(),
            ("has_bias", problem.has_bias), ("has_key_bits", problem.has_key_bits),
            ("has_softcap", problem.has_softcap)))

    def config_of(self, spec: PlanKernelSpec, problem: AttentionProblem | None
                  ) -> AttentionConfig:
        names = {f.name for f in dataclasses.fields(AttentionConfig)}
        return AttentionConfig(**{k: v for k, v in spec.params if k in names})

    def owns(self, params: Mapping[str, Any]) -> bool:
        return params.get("kind") == self.kind

    def tuning_key(self, problem: AttentionProblem, profile: GpuProfile,
                   identities: tuple[Any, ...]) -> tuple[Any, ...]:
        """The shape, mask and GPU, and each extra input the node reads (each changes the
        kernel the tuner times; a bias also the space: :func:`.ws_cost.ws_spills`), named
        only when read so that a problem without them keeps its key."""
        p, fmt = problem, problem.fmt
        reads = (("key_bits", p.has_key_bits), ("bias", p.has_bias), ("softcap", p.has_softcap))
        return ("attention", p.batch, p.seq_len, p.heads, p.head_dim, p.dtype, p.layout,
                fmt.spec_hash, fmt.seq_len, fmt.tile, *identities, profile.arch,
                *(name for name, read in reads if read))

    # -- configs --------------------------------------------------------------------
    @abstractmethod
    def prune(self, config: AttentionConfig, head_dim: int, profile: GpuProfile) -> str | None:
        """Why ``config`` cannot run (or not well) on ``profile``, None if it can; a family
        of the usual one-block-per-launch shape ends with :func:`.config.resource_reason`."""

    @abstractmethod
    def smem_bytes(self, config: AttentionConfig, head_dim: int) -> int:
        """Shared memory one block uses."""

    @abstractmethod
    def registers(self, config: AttentionConfig, head_dim: int) -> int:
        """Registers per thread the live arrays need (an estimate)."""

    @abstractmethod
    def rows_per_block(self, config: AttentionConfig) -> int:
        """Query rows one thread block owns."""

    @abstractmethod
    def describe(self, config: AttentionConfig) -> str:
        """One line for explanations and reports."""

    @abstractmethod
    def search_space(self, head_dim: int, profile: GpuProfile, *, tile: int, gatherable: bool,
                     permutable: bool) -> list[AttentionConfig]:
        """Every valid config for a format with outer tile ``tile`` (no duplicates)."""

    def template_of(self, config: AttentionConfig) -> str:
        """The template that renders ``config``."""
        return self.templates[0]

    def name_tag(self, config: AttentionConfig) -> str:
        """What the kernel name adds for this family's config (after ``_o<min_blocks>``)."""
        return ""

    def entry_points(self, spec: KernelSpec) -> tuple[str, ...]:
        """The ``extern "C"`` kernels the source defines (main first)."""
        return (spec.name,)

    def template_values(self, spec: KernelSpec) -> dict[str, Any]:
        """Every value the template substitutes (logic-free templates)."""
        c = spec.config
        return {**common_values(spec), "tile": c.tile, "warp_m": c.warp_m, "warps": c.warps,
                "stages": c.stages, "q_split": c.q_split, "min_blocks": c.min_blocks,
                "q_in_regs": FLAG[spec.q_in_regs]}

    def target_for(self, config: AttentionConfig, target: str) -> str:
        """The NVRTC target ``config``'s kernel compiles for when the GPU's is ``target``."""
        return target

    def nvrtc_target(self, kernel: KernelInstance, target: str) -> str:
        return self.target_for(kernel.config, target)

    def space(self, problem: AttentionProblem, profile: GpuProfile) -> Any:
        raise NotImplementedError("attention spaces are lists of configs (see candidates)")

    def candidates(self, problem: AttentionProblem, profile: GpuProfile
                   ) -> tuple[list[AttentionConfig], dict[str, int]]:
        """:meth:`search_space` for the format, with its gather / permutation switches only
        when they change the walk list."""
        fmt = problem.fmt
        check_dtype(problem.dtype)
        configs = self.search_space(problem.head_dim, profile, tile=fmt.tile,
                                    gatherable=plan_tiles(fmt, gather=True).gathered > 0,
                                    permutable=choose_permutation(fmt) is not None)
        return configs, {}

    # -- the selector ---------------------------------------------------------------
    @abstractmethod
    def starting_config(self, fmt: MaskFormat, profile: GpuProfile, *, batch: int, heads: int,
                        seq_len: int, head_dim: int, extras: ExtraInputs
                        ) -> AttentionConfig | None:
        """The analytical config for this mask and shape, for a node that also reads
        ``extras`` (None: none fits)."""

    def unavailable(self, fmt: MaskFormat, head_dim: int) -> str:
        """Why :meth:`starting_config` found nothing (for the selector's explanation)."""
        return f"no {self.label} config fits T={fmt.tile} with head_dim={head_dim}"

    @abstractmethod
    def estimate_us(self, fmt: MaskFormat, profile: GpuProfile, config: AttentionConfig, *,
                    batch: int, heads: int, seq_len: int, head_dim: int) -> float:
        """The cost model: the estimated time of ``config`` on this mask and shape."""

    @abstractmethod
    def advantage(self, fmt: MaskFormat) -> str:
        """Why this family wins when its estimate is the lower one (the explanation)."""

    def runtime_variants(self, choice: KernelChoice, fmt: MaskFormat, profile: GpuProfile, *,
                         batch: int, heads: int, head_dim: int
                         ) -> tuple[KernelChoice, tuple[AttentionVariant, ...]]:
        """The base kernel of ``choice`` and the kernels the node switches to at run time."""
        return choice, ()

    def default(self, problem: AttentionProblem, profile: GpuProfile) -> AttentionConfig | None:
        return self.starting_config(problem.fmt, profile, batch=problem.batch,
                                    heads=problem.heads, seq_len=problem.seq_len,
                                    head_dim=problem.head_dim, extras=problem.extras)

    # -- launch -----------------------------------------------------------------------
    @abstractmethod
    def blocks_per_tile_row(self, config: AttentionConfig) -> int:
        """Thread blocks per (batch, head, tile row)."""

    def dynamic_smem(self, config: AttentionConfig, head_dim: int) -> int:
        """Dynamic shared memory the launch asks for (0: the kernel's is static)."""
        return self.smem_bytes(config, head_dim)

    def shared_blocks_per_sm(self, config: AttentionConfig) -> int:
        """Blocks of the main kernel that must share one SM's shared memory (a persistent
        grid of several blocks an SM): where more than one, the loader asks the driver for
        the largest shared-memory carveout, which the default preference need not give."""
        return 1

    def launch(self, config: AttentionConfig, head_dim: int) -> tuple[tuple[str, int], ...]:
        """SparseAttention's launch attributes (OPS.md): threads, blocks per tile row, smem."""
        return (("block_threads", config.threads),
                ("blocks_per_tile_row", self.blocks_per_tile_row(config)),
                ("smem_bytes", self.dynamic_smem(config, head_dim)))

    def walk(self, fmt: MaskFormat, config: AttentionConfig) -> Walk:
        """What the kernel walks on ``fmt`` (see :class:`.launch.Walk`): the walk-list
        kernels' (a form with other launch data overrides :meth:`launch_data` instead)."""
        raise NotImplementedError(f"{self.name} has no walk list")

    def launch_data(self, fmt: MaskFormat, config: AttentionConfig) -> LaunchData:
        """The launch data of ``config`` on ``fmt`` (:func:`.launch.launch_data`): what the
        CuPy runtime uploads and the package writes as ``*.plan.bin``, computed here only."""
        return assemble(self.kind, fmt, self.walk(fmt, config))

    def launch_key(self, config: AttentionConfig) -> str:
        """What tells this config's launch data apart on one mask (the plan file's name)."""
        return self.kind

    # -- kernels ----------------------------------------------------------------------
    def kernels(self, problem: AttentionProblem, config: AttentionConfig
                ) -> tuple[KernelInstance, ...]:
        return (KernelInstance(self.name, problem, config,
                               problem.kernel_spec(config).name),)

    def render(self, kernel: KernelInstance) -> Source:
        return render_kernel(kernel.problem.kernel_spec(kernel.config))
