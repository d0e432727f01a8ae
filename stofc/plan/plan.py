"""The fusion plan: per layer, a scheme and its segments, each with a kernel spec.

``plan.json`` fragment (``Plan.to_json``), schema :data:`SCHEMA_VERSION`::

    {"schema": 1, "gpu": "h100", "arch": "sm_90", "dtype": "float16",
     "max_seq_len": 512, "tokens": 512, "mask": "<spec hash or text>",
     "layers": [{"index": 0, "norm_order": "post", "scheme": [0, 0, 1, ...],
                 "segments": [{"ordinal": 0, "ops": [0, 1], "family": "gemm",
                               "epilogues": [{...}], "bindings": [["x", "..."], ...],
                               "dims": [["k0", 768], ...], "epsilon": 0.0,
                               "roles": ["qkv"], "inputs": [...], "outputs": [...],
                               "kernel": {"family": "gemm", "template": "gemm/gemm.cu.j2",
                                          "params": [["bm", 128], ...]}}, ...]}]}

Every dataclass here is frozen; ``from_json(to_json(p)) == p``. :class:`KernelSpec` lives in
:mod:`stofc.kernels.spec` (kernel families write and read it); it is re-exported here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from stofc.errors import PlanError
from stofc.kernels.epilogue import Epilogue
from stofc.kernels.spec import KernelSpec
from stofc.plan.scheme import FusionScheme

SCHEMA_VERSION = 1
__all__ = ["SCHEMA_VERSION", "KernelSpec", "LayerPlan", "Plan", "Segment", "TunedPlan"]


@dataclass(frozen=True)
class Segment:
    """One fused kernel's worth of a layer chain (see ``stofc.plan.families``)."""

    layer: int
    ordinal: int
    ops: tuple[int, ...]
    family: str
    epilogues: tuple[Epilogue, ...]
    bindings: tuple[tuple[str, str], ...]
    dims: tuple[tuple[str, int], ...]
    epsilon: float
    roles: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    kernel: KernelSpec

    def binding(self, slot: str) -> str | None:
        for key, value in self.bindings:
            if key == slot:
                return value
        return None

    def dim(self, name: str) -> int:
        return dict(self.dims)[name]

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "ordinal": self.ordinal, "ops": list(self.ops),
                "family": self.family,
                "epilogues": [dict(e.as_params()) for e in self.epilogues],
                "bindings": [list(b) for b in self.bindings],
                "dims": [list(d) for d in self.dims], "epsilon": self.epsilon,
                "roles": list(self.roles), "inputs": list(self.inputs),
                "outputs": list(self.outputs), "kernel": self.kernel.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Segment:
        return cls(layer=d["layer"], ordinal=d["ordinal"], ops=tuple(d["ops"]),
                   family=d["family"],
                   epilogues=tuple(Epilogue.from_params(e) for e in d["epilogues"]),
                   bindings=tuple((k, v) for k, v in d["bindings"]),
                   dims=tuple((k, int(v)) for k, v in d["dims"]), epsilon=float(d["epsilon"]),
                   roles=tuple(d["roles"]), inputs=tuple(d["inputs"]),
                   outputs=tuple(d["outputs"]), kernel=KernelSpec.from_dict(d["kernel"]))


@dataclass(frozen=True)
class LayerPlan:
    """One layer: its fusion scheme and the segments it maps to."""

    index: int
    norm_order: str
    scheme: FusionScheme
    segments: tuple[Segment, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "norm_order": self.norm_order,
                "scheme": self.scheme.to_json(),
                "segments": [s.to_dict() for s in self.segments]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerPlan:
        return cls(d["index"], d["norm_order"], FusionScheme.from_json(d["scheme"]),
                   tuple(Segment.from_dict(s) for s in d["segments"]))


@dataclass(frozen=True)
class Plan:
    """The whole model's plan; ``tokens`` is the token count configs were chosen for."""

    gpu: str
    arch: str
    dtype: str
    max_seq_len: int
    tokens: int
    mask: str
    layers: tuple[LayerPlan, ...]
    schema: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"schema": self.schema, "gpu": self.gpu, "arch": self.arch, "dtype": self.dtype,
                "max_seq_len": self.max_seq_len, "tokens": self.tokens, "mask": self.mask,
                "layers": [layer.to_dict() for layer in self.layers]}

    def to_json(self) -> str:
        """The plan as JSON text (stable key order)."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        schema = d.get("schema")
        if schema != SCHEMA_VERSION:
            raise PlanError(f"plan schema {schema!r} is not the supported {SCHEMA_VERSION}",
                            hint="recompile the model with this stofc version")
        try:
            return cls(gpu=d["gpu"], arch=d["arch"], dtype=d["dtype"],
                       max_seq_len=int(d["max_seq_len"]), tokens=int(d["tokens"]),
                       mask=d["mask"], layers=tuple(LayerPlan.from_dict(x) for x in d["layers"]))
        except (KeyError, TypeError, ValueError) as err:
            raise PlanError(f"plan is malformed ({type(err).__name__}: {err})",
                            hint="recompile the model; do not edit plan.json by hand") from None

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of :meth:`to_json`; a wrong schema or shape is a :class:`PlanError`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanError(f"plan is not valid JSON ({err.msg} at line {err.lineno})",
                            hint="recompile the model") from None
        if not isinstance(data, dict):
            raise PlanError("plan JSON is not an object", hint="recompile the model")
        return cls.from_dict(data)

    def summary(self) -> list[str]:
        """One line per layer: the scheme in STOF notation and the segment families."""
        lines = []
        for layer in self.layers:
            fams = " | ".join(f"{s.family}[{s.kernel.template.split('/')[-1]}]"
                              for s in layer.segments)
            lines.append(f"layer {layer.index} ({layer.norm_order}-norm): {layer.scheme}  ->  "
                         f"{fams}")
        return lines


@dataclass(frozen=True)
class TunedPlan:
    """The plan a package is built from, after the (optional) tune stage.

    ``plan``: the package's plan (the largest bucket's when tuned: its kernels take
    the length at run time); ``buckets``: ``(length, plan)`` of every tuned
    sequence-length bucket, whose shorter buckets' attention configs become run-time
    variants and whose cuBLASLt ranks become FusedGemm attributes. ``tuned``: the
    plan's kernel configs were measured (or given), not the analytical ones; the
    selector's own run-time variants then give way to the buckets'. ``report``: the
    tuner's measurements (:class:`stofc.tune.plan_tuner.PlanTuning`), when it ran.
    """

    plan: Plan
    buckets: tuple[tuple[int, Plan], ...] = ()
    tuned: bool = False
    report: Any = None

    @classmethod
    def untuned(cls, plan: Plan) -> TunedPlan:
        """An analytical plan passed through the road unchanged."""
        return cls(plan)
