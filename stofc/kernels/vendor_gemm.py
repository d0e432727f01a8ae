"""The vendor path (family ``vendor_gemm``): cuBLAS(Lt), then the Add+Norm kernel as epilogue.

``gemm`` and ``gemm_norm`` segments may run on cuBLASLt (through
:mod:`stofc.runtime.segment_cublas`, with the same descriptors as the ORT
library's ``FusedGemm``) followed by the Add+Norm template
(:mod:`stofc.kernels.norm`) for what cuBLASLt's epilogue cannot fold. It is the
analytical default of row-major GEMMs (``preference`` 0): measured on an H200
(bench/results/layer-gemm-sweep-h200-2026-11-22.json) cuBLAS ran the BERT-base
GEMMs 1.3-1.7x faster than the best mma.sync template config at 128 tokens and
1.9-2.6x faster at 4096-32768 tokens, more than the epilogue pass it adds. The
head-split QKV store has no vendor path (:meth:`VendorGemm.unsupported`).

What cuBLASLt folds is decided here, once, for every user: :func:`lt_split` (the
CuPy runtime and the tuner, whose epilogues may hold a ReLU) and
:func:`split_fused_gemm` (``FusedGemm``'s CUDA twin, the C++ ``split_fused_gemm``).

Config (:class:`VendorConfig`): ``lt`` (through cuBLASLt with its epilogue, else
plain cuBLAS and the whole epilogue in the kernel), ``tpr`` / ``rows`` of the
epilogue kernel, and ``lt_algo``: the rank of the cuBLASLt heuristic result used
(``cublasLtMatmulAlgoGetHeuristic`` asked for ``lt_algo + 1`` results; 0 is its first
choice and the analytical default). Ranks 0..``LT_ALGO_RANKS - 1`` (8) are searched,
crossed with the epilogue kernel's configs (the two launches are independent, but
the best pair needs both axes). Pruning: the heuristic sorts its candidates by its
own estimate, so ranks past 8 rarely win and each costs a measurement per
epilogue config; the number actually returned is known only on the GPU, so a
rank it does not return is rejected when measured, never timed as a duplicate of
the last. A tuned rank is valid for one M: the KernelSpec carries
``("lt_algo", rank), ("lt_m", tokens)`` (both only when the rank is not 0, so
untuned specs are unchanged); at any other M the runtimes use rank 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stofc.codegen import Source
from stofc.errors import PlanError
from stofc.kernels import norm as norm_family
from stofc.kernels.epilogue import Epilogue
from stofc.kernels.gemm import GemmProblem, GemmSegmentFamily
from stofc.kernels.registry import KernelInstance, ParamValue, register
from stofc.kernels.spec import KernelSpec
from stofc.runtime.segment_cublas import LT_WORKSPACE, lt_version
from stofc.targets import GpuProfile

TEMPLATE = "vendor/cublas"
LT_ALGO, LT_M = "lt_algo", "lt_m"          # the KernelSpec's tuned-algorithm params
LT_ALGO_RANKS = 8                         # heuristic ranks searched (module doc: pruning)
# cublasLtEpilogue_t codes
LT_DEFAULT, LT_RELU, LT_BIAS, LT_RELU_BIAS, LT_GELU, LT_GELU_BIAS = 1, 2, 4, 6, 32, 36


def lt_split(bias: bool, act: str, residual: bool) -> tuple[int, bool]:
    """``(cuBLASLt epilogue code, whether it also applies act)`` for what Lt can fold.

    Lt computes ``act(A B + beta C + bias)``: the residual (C) can join only when no
    activation follows the bias (our order is act(AB + bias) + residual). Lt applies
    ReLU and the tanh GELU (``gelu_tanh``, its GELU epilogue's formula) itself when no
    residual follows; ``gelu_erf`` is never replaced by the tanh form.
    """
    if act == "relu" and not residual:
        return (LT_RELU_BIAS if bias else LT_RELU), True
    if act == "gelu_tanh" and not residual:
        return (LT_GELU_BIAS if bias else LT_GELU), True
    return (LT_BIAS if bias else LT_DEFAULT), act == "none"


def vendor_rest(ep: Epilogue, lt: bool) -> Epilogue:
    """What the vendor path leaves to the Add+Norm kernel after the GEMM (the pre-norm
    store not counted): cuBLASLt folds what :func:`lt_split` says, and the residual
    as C when no activation is applied; plain cuBLAS folds nothing."""
    if not lt:
        return dataclasses.replace(ep, store_pre_norm=False)
    _, act_done = lt_split(ep.bias, ep.act, ep.residual)
    fold_residual = ep.residual and ep.act == "none"
    return Epilogue(bias=False, act="none" if act_done else ep.act,
                    residual=ep.residual and not fold_residual, norm=ep.norm,
                    norm_shift=ep.norm_shift)


@dataclass(frozen=True)
class GemmSplit:
    """What FusedGemm's CUDA twin does: the Lt epilogue, residual as C, the rest's Epilogue."""

    lt_epilogue: int
    lt_residual: bool
    rest: Epilogue


def split_fused_gemm(has_bias: bool, act: str, has_residual: bool,
                     residual_after_activation: bool = True) -> GemmSplit:
    """The split with cuBLASLt for one ``FusedGemm`` node (its CUDA twin's).

    ReLU never reaches FusedGemm, so Lt folds the bias; the residual joins as C
    (beta = 1) only when no activation is applied after it is added. Lt also applies
    ``gelu_tanh`` (its GELU epilogue is the tanh form) when no residual is involved:
    ``y = gelu_tanh(x@w + bias)`` comes out of cuBLASLt with no epilogue kernel.
    ``gelu_erf`` always stays with the epilogue kernel.
    """
    if act == "gelu_tanh" and not has_residual:
        return GemmSplit(LT_GELU_BIAS if has_bias else LT_GELU, False, Epilogue())
    lt_residual = has_residual and (act == "none" or not residual_after_activation)
    return GemmSplit(LT_BIAS if has_bias else LT_DEFAULT, lt_residual,
                     Epilogue(act=act, residual=has_residual and not lt_residual))


def vendor_tag() -> str:
    """The vendor path's identity in GEMM tuning keys: cuBLASLt version, weight layout and
    what Lt folds (``lt2``: the tanh GELU joined the bias and ReLU; a rank measured with
    the older split timed another epilogue) and the workspace the heuristic may use
    (``ws0``: none, :data:`~stofc.runtime.segment_cublas.LT_WORKSPACE`; ranks measured
    under the old 32 MiB preference named other algorithms)."""
    return f"cublasLt:{lt_version() or 'none'}:w_kn:lt2:ws{LT_WORKSPACE >> 20}"


@dataclass(frozen=True)
class VendorConfig:
    """cuBLASLt (``lt``) or plain cuBLAS, the epilogue kernel's shape, the heuristic rank."""

    lt: bool
    tpr: int
    rows: int
    lt_algo: int = 0

    @property
    def epilogue(self) -> norm_family.NormConfig:
        return norm_family.NormConfig(self.tpr, self.rows)


@register
class VendorGemm(GemmSegmentFamily[VendorConfig]):
    """``gemm`` and ``gemm_norm`` segments on cuBLAS(Lt) plus the Add+Norm epilogue kernel."""

    name = "vendor_gemm"
    segments = ("gemm", "gemm_norm")
    templates = (TEMPLATE,)
    config_type = VendorConfig
    preference = 0
    space_order = 10
    tuner_tag = (("impl", "cublas"),)
    vendor = True

    def unsupported(self, problem: GemmProblem, profile: GpuProfile) -> str | None:
        return None if problem.store == "row" else "the vendor path stores row-major only"

    def _norm_problem(self, problem: GemmProblem, ep: Epilogue) -> norm_family.NormProblem:
        return norm_family.NormProblem(problem.m, problem.n, problem.dtype, ep)

    def candidates(self, problem: GemmProblem, profile: GpuProfile
                   ) -> tuple[list[VendorConfig], dict[str, int]]:
        """Per library (cuBLASLt, cuBLAS): the epilogue kernel's space over what is left
        (one default config when nothing is), cuBLASLt's crossed with the ranks."""
        configs: list[VendorConfig] = []
        reasons: dict[str, int] = {}
        for lt in (True, False):
            rest = vendor_rest(problem.epilogue, lt)
            if rest.is_identity:   # nothing left for the epilogue kernel to do
                cfg = norm_family.default_config(self._norm_problem(problem, problem.epilogue),
                                                 profile)
                shapes = [(cfg.tpr, cfg.rows)]
            else:
                space = norm_family.space(self._norm_problem(problem, rest), profile)
                shapes = [(c["tpr"], c["rows"]) for c in space.configs()]
                prefix = f"cublas{'Lt' if lt else ''} epilogue: "
                for k, v in space.explain().items():
                    if k != "valid":
                        reasons[prefix + k] = reasons.get(prefix + k, 0) + v
            ranks = range(LT_ALGO_RANKS) if lt else (0,)
            configs += [VendorConfig(lt, tpr, rows, r) for tpr, rows in shapes for r in ranks]
        return configs, reasons

    def space(self, problem: GemmProblem, profile: GpuProfile) -> Any:
        raise NotImplementedError("the vendor path's space is two libraries' (see candidates)")

    def default(self, problem: GemmProblem, profile: GpuProfile) -> VendorConfig:
        cfg = norm_family.default_config(self._norm_problem(problem, problem.epilogue), profile)
        return VendorConfig(True, cfg.tpr, cfg.rows)

    def spec(self, problem: GemmProblem, config: VendorConfig) -> KernelSpec:
        params: tuple[tuple[str, Any], ...] = (
            ("dtype", problem.dtype), ("store", problem.store), ("lt", config.lt),
            ("tpr", config.tpr), ("rows", config.rows))
        rank = config.lt_algo if config.lt else 0
        if rank:
            if problem.m < 1:
                raise PlanError(f"a cuBLASLt rank ({rank}) needs the M it was tuned at",
                                hint="this is a stofc bug; report it")
            params = (*params, (LT_ALGO, rank), (LT_M, int(problem.m)))
        return KernelSpec(problem.segment, TEMPLATE, params)

    def config_of(self, spec: KernelSpec, problem: Any) -> VendorConfig:
        """The spec's config; its rank applies only at the M it was tuned at (``lt_m``):
        at another M (``problem.m``) the rank is 0, as at run time."""
        lt = bool(spec.param("lt", True))
        rank = int(spec.param(LT_ALGO, 0) or 0) if lt else 0
        lt_m = spec.param(LT_M)
        if problem is not None and lt_m is not None and int(lt_m) != problem.m:
            rank = 0
        return VendorConfig(lt, int(spec.param("tpr")), int(spec.param("rows")), rank)

    def params(self, config: VendorConfig) -> dict[str, ParamValue]:
        out: dict[str, ParamValue] = {"impl": "cublas", "lt": config.lt, "tpr": config.tpr,
                                      "rows": config.rows}
        if config.lt:
            out[LT_ALGO] = config.lt_algo
        return out

    def from_params(self, params: Mapping[str, Any]) -> VendorConfig:
        return VendorConfig(bool(params["lt"]), int(params["tpr"]), int(params["rows"]),
                            int(params.get(LT_ALGO, 0) or 0))

    def twin_epilogue_config(self, spec: KernelSpec) -> norm_family.NormConfig | None:
        if spec.param("tpr") and spec.param("rows"):
            return norm_family.NormConfig(int(spec.param("tpr")), int(spec.param("rows")))
        return None

    def twin_lt_rank(self, spec: KernelSpec) -> tuple[int, int] | None:
        if not spec.param(LT_ALGO) or not spec.param(LT_M):
            return None
        return int(spec.param(LT_M)), int(spec.param(LT_ALGO))

    def identity(self, problem: GemmProblem) -> tuple[Any, ...]:
        return (vendor_tag(),) if problem.store == "row" else ()

    def kernels(self, problem: GemmProblem, config: VendorConfig) -> tuple[KernelInstance, ...]:
        """The Add+Norm kernel over the segment's whole epilogue: the source the package's
        node names (``kernel``); the runtimes launch the part cuBLASLt leaves
        (:func:`lt_split`, :func:`split_fused_gemm`)."""
        nproblem = self._norm_problem(problem, problem.epilogue)
        return (KernelInstance(norm_family.FAMILY, nproblem, config.epilogue,
                               norm_family.kernel_name(nproblem, config.epilogue)),)

    def render(self, kernel: KernelInstance) -> Source:
        raise NotImplementedError("vendor_gemm's kernels are the add_norm family's")
