"""The plan's record of which kernel runs a segment: :class:`KernelSpec`.

A kernel family writes it (:meth:`~stofc.kernels.registry.KernelFamily.spec`) and reads
it back (:meth:`~stofc.kernels.registry.KernelFamily.config_of`); plan.json stores it as
``{"family": segment kind, "template": ..., "params": [[name, value], ...]}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class KernelSpec:
    """Which template (or ``vendor/cublas``) runs a segment, with which parameters.

    ``family`` is the segment kind (``gemm``, ``attention``...), ``template`` names the
    kernel family's template (the registry finds the family by the pair).
    """

    family: str
    template: str
    params: tuple[tuple[str, Any], ...] = ()

    def param(self, name: str, default: Any = None) -> Any:
        for key, value in self.params:
            if key == name:
                return value
        return default

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "template": self.template,
                "params": [[k, _thaw(v)] for k, v in self.params]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelSpec:
        return cls(data["family"], data["template"],
                   tuple((k, _freeze(v)) for k, v in data["params"]))
