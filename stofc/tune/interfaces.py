"""The contracts the tuning engine is written against.

The engine (stage 1, stage 2, measurement, database) knows nothing about
kernels. The plan and kernel modules plug in by providing objects that satisfy
these protocols; the simulated cost model in :mod:`tests.tune_simulate` is the
reference implementation the CI tests drive.

Concrete values (owned here, constructed by anyone):

* :class:`Config`: one point of a kernel family's parameter space, an
  immutable name → value mapping with a stable :attr:`Config.key`.
* :class:`Scheme`: a fusion scheme, one value per operator of a layer chain
  (STOF's encoding); maximal runs of equal values are segments.
* :class:`Move`: one boundary change (expand / seize / compete) and the scheme
  it produces.
* :class:`Measurement`: a time in ms, or the fault that prevented one.

Protocols (implemented by ``stofc.plan`` / ``stofc.kernels``):

* :class:`SegmentSpace`: the search space of one segment (a kernel family on
  one problem shape) after analytical pruning.
* :class:`SchemeSpace`: a layer chain's initial scheme, its legal moves, and
  the segment spaces of any scheme.
* :class:`Measurer`: times one config of one segment (on the GPU, in an
  isolated worker) and checks a winning config against the reference.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

ParamValue = int | float | str | bool

MoveKind = Literal["expand", "seize", "compete", "split"]


@dataclass(frozen=True)
class Config(Mapping[str, ParamValue]):
    """One parameter setting of a kernel family: an immutable mapping.

    Items are stored sorted by name, so two configs with the same values are
    equal, hash alike and have the same :attr:`key` whatever order they were
    built in. Values must be JSON scalars (int, float, str, bool).
    """

    items_: tuple[tuple[str, ParamValue], ...]

    @classmethod
    def of(cls, mapping: Mapping[str, ParamValue] | None = None, /,
           **params: ParamValue) -> Config:
        """``Config.of({"block_m": 64})`` or ``Config.of(block_m=64, warps=4)``."""
        merged = {**(mapping or {}), **params}
        for name, value in merged.items():
            if not isinstance(value, (int, float, str, bool)):
                raise TypeError(f"config value {name}={value!r} is not a JSON scalar")
        return cls(tuple(sorted(merged.items())))

    @classmethod
    def from_key(cls, key: str) -> Config:
        """The inverse of :attr:`key` (configs read back from the database)."""
        return cls.of(json.loads(key))

    @functools.cached_property
    def key(self) -> str:
        """Canonical JSON (sorted keys, no spaces): stable across runs and processes."""
        return json.dumps(dict(self.items_), sort_keys=True, separators=(",", ":"))

    def replace(self, **params: ParamValue) -> Config:
        """A copy with some parameters changed."""
        return Config.of(dict(self.items_), **params)

    def __getitem__(self, name: str) -> ParamValue:
        for key, value in self.items_:
            if key == name:
                return value
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (key for key, _ in self.items_)

    def __len__(self) -> int:
        return len(self.items_)

    def __repr__(self) -> str:
        return f"Config({self.key})"


@dataclass(frozen=True)
class Scheme:
    """A fusion scheme: one value per operator; equal neighbours share a segment.

    ``Scheme((0, 1, 0, 0, 0, 1))`` has segments ``(0,) (1,) (2, 3, 4) (5,)``.
    Only the boundaries matter: :meth:`from_segments` and :meth:`canonical`
    relabel runs as 0, 1, 0, 1..., so equal partitions compare equal.
    """

    values: tuple[int, ...]

    @classmethod
    def from_segments(cls, segments: Sequence[Sequence[int]]) -> Scheme:
        """Build from contiguous groups of operator indices covering 0..n-1 in order."""
        values: list[int] = []
        for label, group in enumerate(segments):
            if list(group) != list(range(len(values), len(values) + len(group))) or not group:
                raise ValueError(f"segments must be non-empty contiguous runs in order: {segments}")
            values.extend([label % 2] * len(group))
        return cls(tuple(values))

    def canonical(self) -> Scheme:
        """The same partition with runs labelled 0, 1, 0, 1..."""
        return Scheme.from_segments(self.segments())

    def segments(self) -> tuple[tuple[int, ...], ...]:
        """The operator indices of each segment, in chain order."""
        out: list[list[int]] = []
        for index, value in enumerate(self.values):
            if out and self.values[index - 1] == value:
                out[-1].append(index)
            else:
                out.append([index])
        return tuple(tuple(group) for group in out)

    def segment_of(self, op: int) -> tuple[int, ...]:
        """The segment holding operator ``op``."""
        for group in self.segments():
            if op in group:
                return group
        raise IndexError(op)

    def __str__(self) -> str:
        return " ".join("[" + " ".join(str(self.values[i]) for i in g) + "]"
                        if len(g) > 1 else str(self.values[g[0]]) for g in self.segments())


@dataclass(frozen=True)
class Move:
    """One boundary change of stage 1.

    ``kind``: ``expand`` (a segment merges its neighbour), ``seize`` (a segment
    holding a compute-intensive operator takes an operator from an MI-only
    neighbour), ``compete`` (two segments want one operator; the one with a
    single CI operator takes it), ``split`` (the inverse: cut a segment, so a
    greedy initial scheme can be undone). ``ops``: the operators whose segment
    changes.
    ``result``: the scheme after the move. ``reason``: one line for logs.
    """

    kind: MoveKind
    ops: tuple[int, ...]
    result: Scheme
    reason: str = ""


@dataclass(frozen=True)
class Measurement:
    """The outcome of timing one config: ``time_ms`` or a ``fault``, never both.

    ``fault`` is one line (``"timeout after 2.0 s"``, ``"worker died (SIGABRT)"``,
    ``"CUDARuntimeError: cudaErrorIllegalAddress"``, ``"wrong result"``).
    ``cached`` is true when it came from the memo or the database, not the GPU.
    """

    time_ms: float | None
    fault: str | None = None
    cached: bool = False

    def __post_init__(self) -> None:
        if (self.time_ms is None) == (self.fault is None):
            raise ValueError("a Measurement has exactly one of time_ms and fault")

    @property
    def ok(self) -> bool:
        return self.fault is None

    @property
    def score(self) -> float:
        """The time, or +inf for a fault (so faults never win)."""
        return float("inf") if self.time_ms is None else self.time_ms


@runtime_checkable
class SegmentSpace(Protocol):
    """The search space of one segment: a kernel family on one problem shape.

    * ``family``: the kernel family's registry name (``"gemm_layernorm"``,
      ``"attention_blockwise"``...). With ``problem`` and ``compile_options``
      it keys the memo and the tuning database, so two segments with equal
      keys (the same operators in another layer) are tuned once.
    * ``problem``: the shape key, a tuple of JSON scalars (ints, strs), e.g.
      ``(batch * seq_len, 768, 3072)``. Everything that changes the best config
      and is not a parameter belongs here (dtype, mask signature for attention).
    * ``compile_options``: the options that change the binary (NVRTC flags,
      target arch); part of the database key.
    * ``label``: a short human name for progress output (``"ops 7-9 gemm+ln"``).
    * ``configs()``: every config that survived analytical pruning (resource
      limits, occupancy), in a deterministic order. May be empty: the segment
      is then infeasible and a scheme that needs it is rejected.
    * ``default_config()``: the analytical default (the config a plan uses
      untuned); must be one of ``configs()`` when that is not empty.
    * ``prune_reasons()``: why configs were dropped: reason → count, e.g.
      ``{"smem 240 KiB > 227 KiB per block": 12}``.
    """

    family: str
    problem: tuple
    compile_options: tuple[str, ...]
    label: str

    def configs(self) -> Sequence[Config]: ...

    def default_config(self) -> Config: ...

    def prune_reasons(self) -> Mapping[str, int]: ...


@runtime_checkable
class SchemeSpace(Protocol):
    """A layer chain's fusion schemes.

    * ``compute_intensive``: the indices of the chain's CI operators (GEMMs,
      attention). The engine refuses any scheme with more than two of them in
      one segment (STOF's rule), whatever ``moves`` proposes.
    * ``initial()``: the scheme from rules and recognised structures.
    * ``moves(scheme)``: the legal expand / seize / compete moves from
      ``scheme``, in a deterministic order (the engine explores them
      depth-first in that order). Fixed segments (attention) never move.
    * ``segments(scheme)``: one :class:`SegmentSpace` per segment of
      ``scheme.segments()``, same order and length.
    """

    compute_intensive: frozenset[int]

    def initial(self) -> Scheme: ...

    def moves(self, scheme: Scheme) -> Sequence[Move]: ...

    def segments(self, scheme: Scheme) -> Sequence[SegmentSpace]: ...


@runtime_checkable
class Measurer(Protocol):
    """Times configs on the target; the engine's only door to the GPU.

    * ``gpu`` / ``driver``: the device name and driver version measured on
      (database key; e.g. ``"NVIDIA H200"``, ``"580.65.06"``).
    * ``measure(segment, config)``: the median time in ms, or a fault. Must not
      raise for a bad candidate: faults are data. Must be isolated, so a
      faulting candidate does not change later measurements.
    * ``verify(segment, config)``: run the config once and compare against the
      reference; False (or a fault) means the winner is wrong.
    """

    gpu: str
    driver: str

    def measure(self, segment: SegmentSpace, config: Config) -> Measurement: ...

    def verify(self, segment: SegmentSpace, config: Config) -> bool: ...


def segment_key(segment: SegmentSpace) -> tuple[str, str, str]:
    """(family, problem JSON, compile-options JSON): what makes two segments the same."""
    return (segment.family, json.dumps(list(segment.problem), separators=(",", ":")),
            json.dumps(list(segment.compile_options), separators=(",", ":")))
