"""Search spaces with constraints that say why they prune.

A :class:`Space` is a product of named axes (each a tuple of values) and a list
of constraints. A constraint is a function of one candidate (a dict of axis
values plus the fixed problem) that calls ``check(cond, reason)``; a candidate
for which any ``cond`` is false is pruned, and the reason is recorded, so a
tuner (or a person) can ask *why* a configuration is absent
(:meth:`Space.explain`). Modelled on hidet's ``tune.space`` / ``tune.check``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


class Pruned(Exception):
    """Raised by :func:`check` inside a constraint; carries the reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def check(cond: bool, reason: str) -> None:
    """Inside a constraint: prune the candidate with ``reason`` unless ``cond``."""
    if not cond:
        raise Pruned(reason)


Constraint = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Space:
    """Named axes, and constraints over one candidate (``check`` raises on prune).

    ``fixed`` holds the problem (shapes, dtype, GPU limits) every constraint
    may read; it is merged into each candidate dict before the constraints run
    but is not part of the yielded configuration.
    """

    axes: tuple[tuple[str, tuple[Any, ...]], ...]
    constraints: tuple[Constraint, ...]
    fixed: tuple[tuple[str, Any], ...] = field(default=())

    def _candidates(self) -> Iterator[dict[str, Any]]:
        names = [name for name, _ in self.axes]
        for values in itertools.product(*(vals for _, vals in self.axes)):
            yield dict(zip(names, values, strict=True))

    def reason(self, config: dict[str, Any]) -> str | None:
        """Why ``config`` is pruned (the first failing check), or None if valid."""
        env = {**dict(self.fixed), **config}
        for constraint in self.constraints:
            try:
                constraint(env)
            except Pruned as pruned:
                return pruned.reason
        return None

    def configs(self) -> list[dict[str, Any]]:
        """Every valid configuration, in axis order (deterministic)."""
        return [c for c in self._candidates() if self.reason(c) is None]

    def explain(self) -> dict[str, int]:
        """How many candidates each reason pruned (``"valid"`` counts survivors)."""
        counts: dict[str, int] = {}
        for cand in self._candidates():
            key = self.reason(cand) or "valid"
            counts[key] = counts.get(key, 0) + 1
        return counts

    @property
    def size(self) -> int:
        """Number of candidates before pruning."""
        total = 1
        for _, values in self.axes:
            total *= len(values)
        return total
