"""The tuning driver: stage 1 then stage 2 over one layer chain, top to bottom.

:func:`tune_chain` is what a package (or a test with the simulated model)
calls: it needs a :class:`~stofc.tune.interfaces.SchemeSpace`, a
:class:`~stofc.tune.interfaces.Measurer`, optionally an open
:class:`~stofc.tune.db.TuningDatabase` (warm cache: nothing already stored is
measured again) and a :class:`~stofc.tune.progress.Reporter`.

Time budget: stage 1 may use ``stage1_share`` of ``budget_s``; stage 2 runs
until the whole budget is spent or it converges.
"""

from __future__ import annotations

from dataclasses import dataclass

from stofc.tune.db import TuningDatabase
from stofc.tune.evaluate import Evaluator, EvaluatorStats
from stofc.tune.interfaces import Measurer, Scheme, SchemeSpace
from stofc.tune.progress import Reporter, SummaryRow
from stofc.tune.stage1 import Stage1Result, search_scheme
from stofc.tune.stage2 import Stage2Result, search_params


@dataclass(frozen=True)
class TuneResult:
    """The chosen scheme, both stages' results, what was measured, and the wall time."""

    scheme: Scheme
    stage1: Stage1Result
    stage2: Stage2Result
    stats: EvaluatorStats
    elapsed_s: float

    def summary_rows(self) -> list[SummaryRow]:
        """One row per distinct tuned segment (default vs tuned time)."""
        return [SummaryRow(segment=s.label, family=s.family, occurrences=s.occurrences,
                           default_ms=s.default_ms, tuned_ms=s.best_ms,
                           config="-" if s.best is None else s.best.key, source=s.source)
                for s in self.stage2.segments]


def tune_chain(space: SchemeSpace, measurer: Measurer, reporter: Reporter, *,
               db: TuningDatabase | None = None, budget_s: float | None = None,
               seed: int = 0, samples_per_segment: int = 4, stage1_share: float = 0.4,
               per_round: int | None = None, evaluator: Evaluator | None = None) -> TuneResult:
    """Choose the fusion scheme and every segment's config for one layer chain.

    Deterministic for a given ``seed`` and measurer. Verified winners are
    written to ``db``. Pass ``evaluator`` to share a memo (and clock) between
    chains; otherwise one is made over ``measurer`` and ``db``.
    """
    evaluator = evaluator or Evaluator(measurer, db)
    clock = evaluator.clock
    start = clock()
    deadline1 = deadline2 = None
    if budget_s is not None:
        deadline1 = start + budget_s * stage1_share
        deadline2 = start + budget_s
    stage1 = search_scheme(space, evaluator, reporter, samples_per_segment=samples_per_segment,
                           seed=seed, deadline=deadline1)
    stage2 = search_params(list(space.segments(stage1.scheme)), evaluator, reporter,
                           per_round=per_round, seed=seed, deadline=deadline2)
    result = TuneResult(scheme=stage1.scheme, stage1=stage1, stage2=stage2,
                        stats=evaluator.stats, elapsed_s=clock() - start)
    reporter.summary(result.summary_rows())
    return result
