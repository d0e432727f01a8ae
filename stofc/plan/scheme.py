"""Fusion schemes: a segmentation of one layer's operator chain (STOF's encoding).

A scheme holds one integer per chain operator; neighbouring operators with the
same value share a segment, a change of value is a boundary (STOF writes
``0 1 [0 0 0 0 0] [1 1 1] ...``). :class:`FusionScheme` keeps the canonical
form, the segment ordinal per operator (``0 0 1 2 2 2 2 ...``), and accepts any
values on input. Whether a scheme is *executable* is decided by
:func:`stofc.plan.families.match_segments`, which maps every segment to a kernel
family or rejects the scheme with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stofc.errors import PlanError


@dataclass(frozen=True)
class FusionScheme:
    """Canonical segment ordinal per chain operator (``codes[i]`` for op ``i``)."""

    codes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.codes:
            raise PlanError("a fusion scheme needs at least one operator",
                            hint="give one value per operator of the layer chain")
        expect = 0
        for pos, code in enumerate(self.codes):
            if pos and code != self.codes[pos - 1]:
                expect += 1
            if code != expect:
                raise PlanError(f"fusion scheme codes {list(self.codes)} are not canonical",
                                hint="build schemes with FusionScheme.from_values(...)")

    @classmethod
    def from_values(cls, values: Sequence[int]) -> FusionScheme:
        """Any per-operator values (a boundary where the value changes) -> canonical."""
        codes: list[int] = []
        for pos, value in enumerate(values):
            if not isinstance(value, int) or isinstance(value, bool):
                raise PlanError(f"fusion scheme value {value!r} at operator {pos} is not an int",
                                hint="encode a scheme as one integer per operator")
            if pos == 0:
                codes.append(0)
            else:
                codes.append(codes[-1] + (value != values[pos - 1]))
        return cls(tuple(codes))

    @classmethod
    def from_segments(cls, segments: Sequence[Sequence[int]]) -> FusionScheme:
        """Contiguous runs of operator indices (``[[0, 1], [2], ...]``) -> scheme."""
        codes: list[int] = []
        for ordinal, seg in enumerate(segments):
            for op in seg:
                if op != len(codes):
                    raise PlanError(f"segment {ordinal} is not contiguous at operator {op}",
                                    hint="segments must cover the chain in order")
                codes.append(ordinal)
        return cls(tuple(codes))

    @classmethod
    def unfused(cls, n_ops: int) -> FusionScheme:
        """Every operator its own segment."""
        return cls(tuple(range(n_ops)))

    def __len__(self) -> int:
        return len(self.codes)

    @property
    def num_segments(self) -> int:
        return self.codes[-1] + 1

    def segments(self) -> tuple[tuple[int, ...], ...]:
        """Operator indices of each segment, in chain order."""
        runs: list[list[int]] = [[] for _ in range(self.num_segments)]
        for pos, code in enumerate(self.codes):
            runs[code].append(pos)
        return tuple(tuple(r) for r in runs)

    def segment_of(self, op: int) -> int:
        """The segment ordinal holding operator ``op``."""
        return self.codes[op]

    def boundaries(self) -> tuple[int, ...]:
        """Operator indices that start a new segment (excluding 0)."""
        return tuple(p for p in range(1, len(self.codes)) if self.codes[p] != self.codes[p - 1])

    def with_boundaries(self, starts: Sequence[int]) -> FusionScheme:
        """A scheme of the same length whose segments start at ``starts`` (plus 0)."""
        cuts = sorted(set(starts) - {0})
        if cuts and (cuts[0] < 1 or cuts[-1] >= len(self.codes)):
            raise PlanError(f"boundary {cuts} outside a chain of {len(self.codes)} operators",
                            hint="boundaries are operator indices 1..n-1")
        codes, ordinal, cut = [], 0, set(cuts)
        for pos in range(len(self.codes)):
            ordinal += pos in cut
            codes.append(ordinal)
        return FusionScheme(tuple(codes))

    def to_json(self) -> list[int]:
        """The plan.json fragment: the canonical code list."""
        return list(self.codes)

    @classmethod
    def from_json(cls, data: object) -> FusionScheme:
        """Inverse of :meth:`to_json` (accepts any per-operator values)."""
        if not isinstance(data, list):
            raise PlanError(f"fusion scheme must be a list of ints, got {type(data).__name__}",
                            hint="write it as e.g. [0, 0, 1, 2, 2, 2, 2]")
        return cls.from_values(data)

    def __str__(self) -> str:
        """STOF's notation: segments of more than one op in brackets, values alternate 0/1."""
        parts = []
        for ordinal, seg in enumerate(self.segments()):
            text = " ".join(str(ordinal % 2) for _ in seg)
            parts.append(f"[{text}]" if len(seg) > 1 else text)
        return " ".join(parts)
