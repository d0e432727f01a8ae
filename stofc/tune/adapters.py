"""Adapters from the plan and kernel modules' objects to the engine's protocols.

* :class:`DeclaredSegment`: a :class:`~stofc.tune.interfaces.SegmentSpace`
  over a declared space (``stofc.kernels.space.Space`` or anything with
  ``configs() -> list[dict]`` and ``explain() -> dict[str, int]``, where
  ``explain`` counts survivors under ``"valid"``). Configs are computed once.
* :class:`LayerSchemeSpace`: a :class:`~stofc.tune.interfaces.SchemeSpace`
  over one frontend :class:`~stofc.frontend.types.Layer`, driven by the plan
  module's ``initial_scheme``, ``neighbours`` (expand / seize / compete /
  split) and ``match_segments``; a caller-supplied ``segment_space(match)``
  turns each ``SegmentMatch`` into a segment space (the kernel family's
  declared space for that problem, or the attention selector's).

The plan module is imported lazily, so the engine does not depend on it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast, get_args

from stofc.frontend.types import OpKind
from stofc.plan.families import match_segments
from stofc.plan.moves import initial_scheme, neighbours
from stofc.plan.scheme import FusionScheme
from stofc.tune.interfaces import Config, Move, MoveKind, Scheme, SegmentSpace


class DeclaredSegment:
    """A segment space over a declared search space (see the module doc).

    ``problem`` must be a tuple of JSON scalars; ``default`` is the family's
    analytical default (a mapping of the same axes). ``payload`` is handed to
    the measurement runner (:class:`~stofc.tune.measure.WorkerMeasurer`).
    """

    def __init__(self, family: str, problem: tuple, space: Any, default: Mapping[str, Any], *,
                 label: str, compile_options: tuple[str, ...] = (), payload: Any = None) -> None:
        self.family = family
        self.problem = tuple(problem)
        self.compile_options = tuple(compile_options)
        self.label = label
        self.payload = payload
        self._space = space
        self._default = Config.of(dict(default))
        self._configs: list[Config] | None = None
        self._reasons: dict[str, int] | None = None

    def configs(self) -> Sequence[Config]:
        if self._configs is None:
            self._configs = [Config.of(dict(c)) for c in self._space.configs()]
        return self._configs

    def default_config(self) -> Config:
        return self._default

    def prune_reasons(self) -> Mapping[str, int]:
        if self._reasons is None:
            self._reasons = {k: v for k, v in self._space.explain().items() if k != "valid"}
        return self._reasons

    def __repr__(self) -> str:
        return f"DeclaredSegment({self.family}, {self.problem})"


def _changed_ops(before: Scheme, after: Scheme) -> tuple[int, ...]:
    old, new = set(before.segments()), set(after.segments())
    return tuple(sorted({op for group in old ^ new for op in group}))


class LayerSchemeSpace:
    """The fusion schemes of one layer chain, through ``stofc.plan`` (see the module doc)."""

    def __init__(self, layer: Any, *, tokens: int,
                 segment_space: Callable[[Any], SegmentSpace]) -> None:

        self.layer = layer
        self.tokens = tokens
        self.segment_space = segment_space
        self.compute_intensive = frozenset(
            i for i, op in enumerate(layer.chain) if op.kind in (OpKind.GEMM, OpKind.ATTENTION))
        self._segments: dict[Scheme, list[SegmentSpace]] = {}

    @staticmethod
    def _fusion(scheme: Scheme) -> Any:
        return FusionScheme.from_values(list(scheme.values))

    def initial(self) -> Scheme:
        return Scheme(initial_scheme(self.layer, tokens=self.tokens).codes).canonical()

    def moves(self, scheme: Scheme) -> Sequence[Move]:
        out = []
        for move in neighbours(self.layer, self._fusion(scheme)):
            result = Scheme(move.scheme.codes).canonical()
            if move.kind not in get_args(MoveKind):
                raise ValueError(f"unknown stage-1 move kind {move.kind!r}")
            out.append(Move(cast(MoveKind, move.kind), _changed_ops(scheme, result), result,
                            f"{move.kind} segment {move.segment} ({move.side})"))
        return out

    def segments(self, scheme: Scheme) -> Sequence[SegmentSpace]:
        key = scheme.canonical()
        if key not in self._segments:
            self._segments[key] = [self.segment_space(m)
                                   for m in match_segments(self.layer, self._fusion(scheme))]
        return self._segments[key]
