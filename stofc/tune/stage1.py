"""Stage 1: the fusion-scheme search (STOF's boundary expansion).

Start from the space's initial scheme. Take its moves (expand / seize /
compete) in the order the space gives them; judge each by the best of a fixed
sample of configs of the segments the move changes, before and after. Keep a
move that makes those segments faster by more than ``min_gain`` (and descend
from the new scheme at once: depth-first), roll it back otherwise. Stop when
no move from the current scheme is kept, or at the deadline. A local change
already rolled back (the same segments replaced by the same segments, seen
again from a later scheme) is not judged again.

A scheme with more than two compute-intensive operators in one segment is
refused before anything is measured, whatever the space proposes. Every
scheme is judged at most once; every config is measured at most once (the
:class:`~stofc.tune.evaluate.Evaluator`'s memo).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stofc.errors import StofcError
from stofc.tune.evaluate import Evaluator, sample_configs
from stofc.tune.interfaces import Move, Scheme, SchemeSpace, SegmentSpace, segment_key
from stofc.tune.progress import Progress, Reporter

MAX_CI_PER_SEGMENT = 2


@dataclass(frozen=True)
class MoveDecision:
    """How one move was judged: sampled cost of the changed segments before and after."""

    move: Move
    before_ms: float
    after_ms: float
    kept: bool
    reason: str


@dataclass(frozen=True)
class Stage1Result:
    """The chosen scheme, where it started, every decision, and the chosen scheme's cost."""

    initial: Scheme
    scheme: Scheme
    decisions: tuple[MoveDecision, ...]
    cost_ms: float
    stopped: str  # "converged" | "deadline"


def ci_violations(scheme: Scheme, compute_intensive: frozenset[int]) -> list[tuple[int, ...]]:
    """The segments of ``scheme`` holding more than two compute-intensive operators."""
    return [g for g in scheme.segments()
            if sum(1 for op in g if op in compute_intensive) > MAX_CI_PER_SEGMENT]


def segment_estimate(evaluator: Evaluator, segment: SegmentSpace, samples: int,
                     seed: int) -> float:
    """The best time (ms) over the fixed sample of ``segment``; +inf if none ran."""
    configs = sample_configs(segment, samples, seed)
    return min((m.score for m in evaluator.measure_many(segment, configs)), default=float("inf"))


def _changed(before: Scheme, after: Scheme, before_spaces: Sequence[SegmentSpace],
             after_spaces: Sequence[SegmentSpace]):
    old = dict(zip(before.segments(), before_spaces, strict=True))
    new = dict(zip(after.segments(), after_spaces, strict=True))
    removed = [space for group, space in old.items() if group not in new]
    added = [space for group, space in new.items() if group not in old]
    return removed, added


def search_scheme(space: SchemeSpace, evaluator: Evaluator, reporter: Reporter, *,
                  samples_per_segment: int = 4, seed: int = 0, min_gain: float = 0.02,
                  deadline: float | None = None,
                  clock: Callable[[], float] | None = None) -> Stage1Result:
    """Depth-first boundary expansion from ``space.initial()``; see the module doc.

    ``min_gain``: the relative improvement of the changed segments a move must
    bring to be kept (measurement noise must not fuse). ``deadline``: a time
    on ``clock`` (default the evaluator's) after which no new move is judged.
    """
    clock = clock or evaluator.clock
    start = clock()
    initial = space.initial().canonical()
    bad = ci_violations(initial, space.compute_intensive)
    if bad:
        raise ValueError(f"initial scheme {initial} has segments with > 2 CI operators: {bad}")

    def estimate(segment: SegmentSpace) -> float:
        return segment_estimate(evaluator, segment, samples_per_segment, seed)

    scheme = initial
    spaces = list(space.segments(scheme))
    evaluator.prefetch([(s, c) for s in spaces for c in sample_configs(s, samples_per_segment, seed)])
    cost = sum(estimate(s) for s in spaces)
    visited = {scheme}
    rejected: set[tuple] = set()
    decisions: list[MoveDecision] = []
    stopped = "converged"
    reporter.stage("stage 1", f"fusion scheme search from {scheme}")
    descending = True
    while descending:
        descending = False
        moves = list(space.moves(scheme))
        for index, move in enumerate(moves):
            if deadline is not None and clock() >= deadline:
                stopped = "deadline"
                break
            result = move.result.canonical()
            if result in visited:
                continue
            visited.add(result)
            if ci_violations(result, space.compute_intensive):
                decisions.append(MoveDecision(move, cost, float("inf"), False,
                                              "more than two compute-intensive operators"))
                continue
            try:
                result_spaces = list(space.segments(result))
            except StofcError as err:  # the space cannot run what it proposed: not a crash
                decisions.append(MoveDecision(move, cost, float("inf"), False,
                                              f"not executable: {err}"))
                continue
            removed, added = _changed(scheme, result, spaces, result_spaces)
            change = (tuple(sorted(segment_key(s) for s in removed)),
                      tuple(sorted(segment_key(s) for s in added)))
            if change in rejected:
                continue  # the same local change was already judged and rolled back
            evaluator.prefetch([(s, c) for s in (*removed, *added)
                                for c in sample_configs(s, samples_per_segment, seed)])
            before = sum(estimate(s) for s in removed)
            after = sum(estimate(s) for s in added)
            kept = after < before * (1.0 - min_gain)
            reason = (f"{move.kind} {move.ops}: {before:.4f} -> {after:.4f} ms, "
                      f"{'kept' if kept else 'rolled back'}")
            decisions.append(MoveDecision(move, before, after, kept, reason))
            if not kept:
                rejected.add(change)
            if kept:
                cost = cost - before + after
                scheme, spaces = result, result_spaces
            reporter.progress(Progress(
                stage="stage 1", segment=f"{move.kind} {move.ops}",
                done=len(decisions), planned=len(decisions) + len(moves) - index - 1,
                best_ms=cost, elapsed_s=clock() - start, eta_s=None))
            if kept:
                descending = True
                break
    return Stage1Result(initial=initial, scheme=scheme, decisions=tuple(decisions),
                        cost_ms=cost, stopped=stopped)
