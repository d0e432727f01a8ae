"""The memory-bound tail every downstream kernel family can apply.

One :class:`Epilogue` describes, in this fixed order: add a per-column bias,
apply an activation, add a residual tensor, normalise the row (LayerNorm or
RMSNorm, with scale and optional shift), and whether the pre-norm value is
also stored (pre-LN layers reuse it as the next residual). GEMM templates apply
it to accumulators in registers; the Add+Norm template applies it to a tensor
read from memory (the vendor path's cuBLAS output).
"""

from __future__ import annotations

from dataclasses import dataclass

# codes are positions: templates compare with them (cuda/stofc/gemm_common.cuh activate<>);
# silu (x * sigmoid(x)) serves gated FFNs (SwiGLU: stofc.kernels.glu)
ACTIVATIONS = ("none", "gelu_erf", "gelu_tanh", "relu", "silu")
NORMS = ("none", "layernorm", "rmsnorm")


@dataclass(frozen=True)
class Epilogue:
    """bias -> activation -> residual -> norm (each optional), as a value type."""

    bias: bool = False
    act: str = "none"
    residual: bool = False
    norm: str = "none"
    norm_shift: bool = True       # LayerNorm's beta (False: scale only)
    store_pre_norm: bool = False  # also write the value before the norm

    def __post_init__(self) -> None:
        if self.act not in ACTIVATIONS:
            raise ValueError(f"activation {self.act!r} not in {ACTIVATIONS}")
        if self.norm not in NORMS:
            raise ValueError(f"norm {self.norm!r} not in {NORMS}")
        if self.store_pre_norm and self.norm == "none":
            raise ValueError("store_pre_norm needs a norm")

    @property
    def is_identity(self) -> bool:
        return not (self.bias or self.residual) and self.act == "none" and self.norm == "none"

    @property
    def tag(self) -> str:
        """A short file-name-safe description, e.g. ``b-gelu_erf-r-ln-s``."""
        parts = ["b" if self.bias else "", self.act if self.act != "none" else "",
                 "r" if self.residual else "",
                 {"none": "", "layernorm": "ln", "rmsnorm": "rms"}[self.norm],
                 "ns" if self.norm != "none" and not self.norm_shift else "",
                 "s" if self.store_pre_norm else ""]
        return "-".join(p for p in parts if p) or "plain"

    def template_values(self) -> dict[str, int]:
        """Values the templates substitute (0/1 and codes; no logic in Jinja)."""
        return {
            "HAS_BIAS": int(self.bias),
            "ACT": ACTIVATIONS.index(self.act),
            "HAS_RESIDUAL": int(self.residual),
            "NORM": NORMS.index(self.norm),
            "NORM_SHIFT": int(self.norm_shift and self.norm == "layernorm"),
            "STORE_PRE_NORM": int(self.store_pre_norm),
        }

    def as_params(self) -> tuple[tuple[str, object], ...]:
        return (("bias", self.bias), ("act", self.act), ("residual", self.residual),
                ("norm", self.norm), ("norm_shift", self.norm_shift),
                ("store_pre_norm", self.store_pre_norm))

    @classmethod
    def from_params(cls, params: dict[str, object]) -> Epilogue:
        return cls(bias=bool(params["bias"]), act=str(params["act"]),
                   residual=bool(params["residual"]), norm=str(params["norm"]),
                   norm_shift=bool(params["norm_shift"]),
                   store_pre_norm=bool(params["store_pre_norm"]))
