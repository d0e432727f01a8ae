"""Segments no template implements (family ``ort``): the model's own nodes, run by ONNX Runtime.

An activation no kernel family fuses (QuickGelu, SiLU of a gated MLP, ...) forms a
segment of its own (:mod:`stofc.plan.families`); the package keeps the model's nodes
for it and ONNX Runtime runs them, the fused segments around it reading and writing
its values. The family renders nothing, launches nothing and has nothing to tune.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stofc.codegen import Source
from stofc.kernels.registry import KernelFamily, KernelInstance, PlanContext, SegmentView, register
from stofc.kernels.space import Space
from stofc.kernels.spec import KernelSpec
from stofc.targets import GpuProfile

TEMPLATE = "onnxruntime"


@dataclass(frozen=True)
class OrtConfig:
    """No parameters: ONNX Runtime picks its own kernels."""


@register
class OnnxRuntime(KernelFamily[None, OrtConfig]):
    """The model's own nodes for a segment no template implements."""

    name = "ort"
    segments = ("ort",)
    templates = (TEMPLATE,)
    config_type = OrtConfig
    tunable = False
    untunable = "runs in ONNX Runtime (no template implements it)"
    untunable_hint = "tune models whose layers have no ONNX Runtime segments"

    def problem(self, seg: SegmentView, ctx: PlanContext) -> None:
        return None

    def space(self, problem: None, profile: GpuProfile) -> Space:
        return Space(axes=(), constraints=())

    def default(self, problem: None, profile: GpuProfile) -> OrtConfig:
        return OrtConfig()

    def spec(self, problem: None, config: OrtConfig) -> KernelSpec:
        return KernelSpec("ort", TEMPLATE, (("reason", "no template implements it"),))

    def config_of(self, spec: KernelSpec, problem: Any) -> OrtConfig:
        return OrtConfig()

    def kernels(self, problem: None, config: OrtConfig) -> tuple[KernelInstance, ...]:
        return ()

    def render(self, kernel: KernelInstance) -> Source:
        raise NotImplementedError("ONNX Runtime segments have no kernel to render")
