"""The one door both stages measure through: memo, then database, then measurer.

:class:`Evaluator` guarantees that a (family, problem, compile options,
config) is measured at most once, across stages and, through the database's
``samples`` table, across runs and processes. It counts what it did
(``measured``, ``memo_hits``, ``db_hits``) and logs every GPU measurement in
``measured_keys`` so tests can prove the guarantee.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from stofc.tune.db import RecordKey, Sample, TuningDatabase
from stofc.tune.interfaces import Config, Measurement, Measurer, SegmentSpace, segment_key

SegKey = tuple[str, str, str]


@dataclass
class EvaluatorStats:
    """What the evaluator did: GPU measurements, memo hits, database hits, faults."""

    measured: int = 0
    memo_hits: int = 0
    db_hits: int = 0
    faults: int = 0
    measure_seconds: float = 0.0
    measured_keys: list[tuple[SegKey, str]] = field(default_factory=list)


class Evaluator:
    """Measures configs of segments at most once each (memo → database → measurer)."""

    def __init__(self, measurer: Measurer, db: TuningDatabase | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.measurer = measurer
        self.db = db
        self.clock = clock
        self.stats = EvaluatorStats()
        self._memo: dict[SegKey, dict[str, Measurement]] = {}
        self._verified: dict[tuple[SegKey, str], bool] = {}
        self._winners: dict[SegKey, tuple[Config, float]] = {}

    def record_key(self, segment: SegmentSpace) -> RecordKey:
        """The database key of ``segment`` on this measurer's GPU and driver."""
        family, problem, options = segment_key(segment)
        return RecordKey(family=family, problem=problem, gpu=self.measurer.gpu,
                         driver=self.measurer.driver, compile_options=options)

    def _memo_of(self, segment: SegmentSpace) -> dict[str, Measurement]:
        key = segment_key(segment)
        memo = self._memo.get(key)
        if memo is None:
            memo = {}
            if self.db is not None:
                for sample in self.db.samples(self.record_key(segment)).values():
                    memo[sample.config] = Measurement(sample.time_ms, sample.fault, cached=True)
            self._memo[key] = memo
        return memo

    def memo(self, segment: SegmentSpace) -> Mapping[str, Measurement]:
        """Everything known about ``segment`` (config key → measurement); read-only view."""
        return self._memo_of(segment)

    def known(self, segment: SegmentSpace, config: Config) -> bool:
        """True when ``config`` of ``segment`` needs no measurement."""
        return config.key in self._memo_of(segment)

    def prefetch(self, items: Sequence[tuple[SegmentSpace, Config]]) -> None:
        """Let the measurer prepare (compile in parallel) the unknown ones of ``items``.

        Optional for a measurer (``prepare(items)``); without it, nothing happens.
        """
        prepare = getattr(self.measurer, "prepare", None)
        if prepare is None:
            return
        todo = [(s, c) for s, c in items if c.key not in self._memo_of(s)]
        if todo:
            prepare(todo)

    def measure(self, segment: SegmentSpace, config: Config) -> Measurement:
        """The time of ``config`` on ``segment``; measured only if never seen before."""
        return self.measure_many(segment, [config])[0]

    def measure_many(self, segment: SegmentSpace, configs: Sequence[Config], *,
                     deadline: float | None = None) -> list[Measurement]:
        """Measurements of ``configs`` (in order); only the never-seen ones reach the GPU.

        The new ones go to ``measurer.measure_batch`` when the measurer has it
        (so it can compile them in parallel first), else one by one, stopping
        at ``deadline`` (on this evaluator's clock). A config not measured
        because of the deadline is left out of the result.
        """
        memo = self._memo_of(segment)
        fresh: list[Config] = []
        for config in configs:
            if config.key not in memo and config not in fresh:
                fresh.append(config)
        results: dict[str, Measurement] = {}
        if fresh:
            start = self.clock()
            batch = getattr(self.measurer, "measure_batch", None)
            if batch is not None and (deadline is None or start < deadline):
                results = dict(zip((c.key for c in fresh), batch(segment, fresh), strict=True))
            else:
                for config in fresh:
                    if deadline is not None and self.clock() >= deadline:
                        break
                    results[config.key] = self.measurer.measure(segment, config)
            self.stats.measure_seconds += self.clock() - start
            for key, result in results.items():
                self.stats.measured += 1
                self.stats.measured_keys.append((segment_key(segment), key))
                self.stats.faults += result.fault is not None
                memo[key] = Measurement(result.time_ms, result.fault, cached=False)
            if self.db is not None and results:
                self.db.add_samples(self.record_key(segment),
                                    [Sample(k, r.time_ms, r.fault) for k, r in results.items()])
        out = []
        first = set(results)
        for config in configs:
            hit = memo.get(config.key)
            if hit is None:
                continue
            if config.key in first:
                first.discard(config.key)  # this occurrence was the measurement
            else:
                if hit.cached:
                    self.stats.db_hits += 1
                else:
                    self.stats.memo_hits += 1
            out.append(hit)
        return out

    def verify(self, segment: SegmentSpace, config: Config) -> bool:
        """The measurer's reference check of ``config``, run once per (segment, config)."""
        key = (segment_key(segment), config.key)
        if key not in self._verified:
            self._verified[key] = bool(self.measurer.verify(segment, config))
        return self._verified[key]

    def winner(self, segment: SegmentSpace) -> tuple[Config, float] | None:
        """The verified winner of ``segment`` in this run (or stored in the database)."""
        found = self._winners.get(segment_key(segment))
        if found is None and self.db is not None:
            record = self.db.best(self.record_key(segment))
            if record is not None:
                found = (Config.from_key(record.config), record.time_ms)
        return found

    def set_winner(self, segment: SegmentSpace, config: Config, time_ms: float) -> None:
        """Record ``segment``'s verified winner (and store it in the database)."""
        self._winners[segment_key(segment)] = (config, time_ms)
        if self.db is not None:
            self.db.upsert_best(self.record_key(segment), config.key, time_ms)

    def mark_fault(self, segment: SegmentSpace, config: Config, fault: str) -> None:
        """Record ``config`` of ``segment`` as faulty (e.g. a wrong result at verification)."""
        self._memo_of(segment)[config.key] = Measurement(None, fault, cached=False)
        if self.db is not None:
            self.db.set_sample(self.record_key(segment), Sample(config.key, None, fault))

    def best_known(self, segment: SegmentSpace) -> tuple[Config, Measurement] | None:
        """The fastest successful config measured so far for ``segment``, or None."""
        best: tuple[Config, Measurement] | None = None
        for key, m in self._memo_of(segment).items():
            if m.ok and (best is None or m.score < best[1].score
                         or (m.score == best[1].score and key < best[0].key)):
                best = (Config.from_key(key), m)
        return best


def sample_configs(segment: SegmentSpace, count: int, seed: int) -> list[Config]:
    """A fixed sample of ``count`` configs of ``segment``: the default first, then random.

    Deterministic in (``seed``, family, problem), so the same segment gets the
    same sample before and after a stage-1 move (and the memo answers it).
    """
    configs: Sequence[Config] = segment.configs()
    if not configs or count <= 0:
        return []
    default = segment.default_config()
    rng = random.Random(f"{seed}/{segment.family}/{segment.problem}")
    rest = [c for c in configs if c != default]
    picked = rng.sample(rest, min(count - 1, len(rest)))
    return [default, *picked] if default in configs else picked[:count]
