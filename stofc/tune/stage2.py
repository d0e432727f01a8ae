"""Stage 2: the parameter search, with a sampling budget shared among segments.

Segments with the same (family, problem, compile options) are one search;
its ``occurrences`` weigh its gains (a segment found in 12 layers matters 12
times). Per round, ``per_round`` new measurements are shared: equally in the
first round, then at least one each and the rest in proportion to how much
each segment's best improved in the previous round (in ms of model time).
Within a segment, half its share goes to the untried one-parameter neighbours
of its best config (the next smaller / larger value of one parameter) and the
rest to untried configs drawn at random: local refinement plus exploration.
A parameter a space names in its optional ``unordered`` attribute has no
scale (cuBLASLt's heuristic rank ``lt_algo``: rank 5 is not "near" rank 4), so
every other value of it is a neighbour.
Spaces are already pruned analytically (:meth:`SegmentSpace.configs`).

Stops when every space is exhausted, at the deadline, or after ``patience``
rounds in which no segment improved by more than ``min_gain`` (relative).
A segment already won in this run (an identical segment of another layer) or
with a record in the database is not searched (warm cache; ``source`` says
``"database"`` for both). The
winner of each searched segment is verified once against the reference
(:meth:`Measurer.verify`); a wrong winner is marked as a fault and the next
best is verified instead. Only verified winners are written to the database.
Deterministic for a given ``seed`` (and measurer).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stofc.tune.evaluate import Evaluator
from stofc.tune.interfaces import Config, Measurement, SegmentSpace, segment_key
from stofc.tune.progress import Progress, Reporter

INF = float("inf")


@dataclass(frozen=True)
class SegmentResult:
    """The outcome for one distinct segment."""

    label: str
    family: str
    problem: tuple
    occurrences: int
    default: Config | None
    default_ms: float | None
    best: Config | None
    best_ms: float | None
    measured: int          # new measurements spent on it in stage 2
    source: str            # "measured" | "database" | "infeasible"
    verified: bool


@dataclass(frozen=True)
class Stage2Result:
    segments: tuple[SegmentResult, ...]
    allocations: tuple[tuple[int, ...], ...]   # per round, per searched segment
    gains: tuple[tuple[float, ...], ...]       # per round: each searched segment's gain (ms)
    searched: tuple[str, ...]                  # labels of the searched segments, in order
    rounds: int
    stopped: str  # "converged" | "exhausted" | "deadline" | "database"


@dataclass
class _State:
    space: SegmentSpace
    occurrences: int
    configs: list[Config]
    config_set: set[Config]
    values: dict[str, list]
    rng: random.Random
    measured: int = 0


def _distinct_values(configs: Sequence[Config]) -> dict[str, list]:
    values: dict[str, set] = {}
    for config in configs:
        for name, value in config.items():
            values.setdefault(name, set()).add(value)
    return {name: sorted(vals, key=lambda v: (str(type(v)), v)) for name, vals in values.items()}


def neighbours(best: Config, values: dict[str, list], config_set: set[Config],
               unordered: Sequence[str] = ()) -> list[Config]:
    """The configs that differ from ``best`` by one parameter moved to an adjacent value.

    For a parameter in ``unordered`` every other value is adjacent.
    """
    out = []
    for name in sorted(values):
        ordered = values[name]
        if name not in best or best[name] not in ordered:
            continue
        index = ordered.index(best[name])
        if name in unordered:
            others = [v for i, v in enumerate(ordered) if i != index]
        else:
            others = [ordered[index + step] for step in (-1, 1)
                      if 0 <= index + step < len(ordered)]
        for value in others:
            candidate = best.replace(**{name: value})
            if candidate in config_set:
                out.append(candidate)
    return out


def share_budget(per_round: int, gains: Sequence[float], open_: Sequence[bool]) -> list[int]:
    """Split ``per_round`` among segments: one each (if open), the rest by gain.

    With no gain anywhere the split is equal. Largest-remainder rounding, ties
    to the earlier segment: deterministic.
    """
    n_open = sum(open_)
    if n_open == 0:
        return [0] * len(gains)
    floor = 1 if per_round >= n_open else 0
    shares = [floor if o else 0 for o in open_]
    rest = per_round - floor * n_open
    weights = [max(g, 0.0) if o else 0.0 for g, o in zip(gains, open_, strict=True)]
    if sum(weights) <= 0:
        weights = [1.0 if o else 0.0 for o in open_]
    total = sum(weights)
    exact = [rest * w / total for w in weights]
    ints = [int(e) for e in exact]
    left = rest - sum(ints)
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - ints[i]), i))
    for i in order[:left]:
        ints[i] += 1
    return [s + i for s, i in zip(shares, ints, strict=True)]


def _pick(state: _State, evaluator: Evaluator, count: int) -> list[Config]:
    """Up to ``count`` untried configs: neighbours of the best first (half), then random."""
    space = state.space
    memo = evaluator.memo(space)
    picked: list[Config] = []
    if count <= 0:
        return picked
    default = space.default_config() if state.configs else None
    if default is not None and default.key not in memo:
        picked.append(default)
    best = evaluator.best_known(space)
    if best is not None:
        for cand in neighbours(best[0], state.values, state.config_set,
                               tuple(getattr(space, "unordered", ()))):
            if len(picked) >= max(1, (count + 1) // 2):
                break
            if cand not in picked and cand.key not in memo:
                picked.append(cand)
    chosen = set(picked)
    untried = [c for c in state.configs if c not in chosen and c.key not in memo]
    need = min(count - len(picked), len(untried))
    if need > 0:
        picked.extend(state.rng.sample(untried, need))
    return picked[:count]


def _untried(state: _State, evaluator: Evaluator) -> int:
    memo = evaluator.memo(state.space)
    return sum(1 for c in state.configs if c.key not in memo)


def search_params(segments: Sequence[SegmentSpace], evaluator: Evaluator, reporter: Reporter, *,
                  per_round: int | None = None, seed: int = 0, patience: int = 2,
                  min_gain: float = 0.005, max_rounds: int = 1000,
                  deadline: float | None = None,
                  clock: Callable[[], float] | None = None) -> Stage2Result:
    """Tune the parameters of ``segments`` (duplicates by key are merged); see the module doc."""
    clock = clock or evaluator.clock
    start = clock()
    order: list[tuple] = []
    by_key: dict[tuple, _State] = {}
    for space in segments:
        key = segment_key(space)
        if key in by_key:
            by_key[key].occurrences += 1
            continue
        configs = list(space.configs())
        order.append(key)
        by_key[key] = _State(space, 1, configs, set(configs), _distinct_values(configs),
                             random.Random(f"{seed}/stage2/{key}"))
    states = [by_key[k] for k in order]
    results: dict[tuple, SegmentResult] = {}
    searching: list[_State] = []
    for key, state in zip(order, states, strict=True):
        winner = evaluator.winner(state.space)
        if winner is not None and winner[0] in state.config_set:
            results[key] = _result(state, evaluator, winner[0], winner[1], "database",
                                   verified=True)
        elif not state.configs:
            results[key] = _result(state, evaluator, None, None, "infeasible", verified=False)
        else:
            searching.append(state)
    per_round = per_round or max(8, 4 * len(searching))
    candidates = sum(len(st.configs) for st in searching)
    pruned = sum(sum(st.space.prune_reasons().values()) for st in searching)
    reporter.stage("stage 2", f"parameter search over {len(searching)} segments "
                   f"({len(states) - len(searching)} from the database): {candidates} candidates "
                   f"after analytical pruning ({pruned} pruned), {per_round} measured per round")
    allocations: list[tuple[int, ...]] = []
    gain_log: list[tuple[float, ...]] = []
    stale = 0
    stopped = "database" if not searching else "converged"
    gains = [0.0] * len(searching)
    done = 0
    rounds = 0
    while searching and rounds < max_rounds:
        if deadline is not None and clock() >= deadline:
            stopped = "deadline"
            break
        open_ = [_untried(s, evaluator) > 0 for s in searching]
        if not any(open_):
            stopped = "exhausted"
            break
        shares = share_budget(per_round, gains, open_)
        allocations.append(tuple(shares))
        rounds += 1
        improved = False
        picks = [_pick(state, evaluator, shares[i]) for i, state in enumerate(searching)]
        evaluator.prefetch([(state.space, c)
                            for state, picked in zip(searching, picks, strict=True)
                            for c in picked])
        for i, state in enumerate(searching):
            before = _best_ms(evaluator, state.space)
            picked = picks[i]
            if picked:
                got = evaluator.measure_many(state.space, picked, deadline=deadline)
                state.measured += len(got)
                done += len(got)
                reporter.progress(_progress_event(state, evaluator, done, per_round, start,
                                                  clock, deadline))
            after = _best_ms(evaluator, state.space)
            if after < before:
                gains[i] = (after if before == INF else before - after) * state.occurrences
                improved = improved or before == INF or (before - after) / before > min_gain
            else:
                gains[i] = 0.0
        gain_log.append(tuple(gains))
        stale = 0 if improved else stale + 1
        if stale >= patience:
            stopped = "converged"
            break
    for state in searching:
        key = segment_key(state.space)
        results[key] = _finish(state, evaluator, reporter)
    return Stage2Result(segments=tuple(results[k] for k in order),
                        allocations=tuple(allocations), gains=tuple(gain_log),
                        searched=tuple(s.space.label for s in searching), rounds=rounds,
                        stopped=stopped)


def _best_ms(evaluator: Evaluator, space: SegmentSpace) -> float:
    best = evaluator.best_known(space)
    return INF if best is None else best[1].score


def _progress_event(state: _State, evaluator: Evaluator, done: int, per_round: int,
                    start: float, clock: Callable[[], float], deadline: float | None) -> Progress:
    now = clock()
    elapsed = now - start
    rate = elapsed / done if done else 0.0
    planned = done + per_round
    eta = None
    if deadline is not None:
        eta = max(0.0, deadline - now)
        if rate > 0:
            planned = done + int(eta / rate)
    best = _best_ms(evaluator, state.space)
    return Progress(stage="stage 2", segment=state.space.label, done=done, planned=planned,
                    best_ms=None if best == INF else best, elapsed_s=elapsed, eta_s=eta)


def _default_ms(state: _State, evaluator: Evaluator) -> tuple[Config | None, float | None]:
    if not state.configs:
        return None, None
    default = state.space.default_config()
    if not evaluator.known(state.space, default):
        return default, None
    m: Measurement = evaluator.measure(state.space, default)
    return default, m.time_ms


def _result(state: _State, evaluator: Evaluator, best: Config | None, best_ms: float | None,
            source: str, *, verified: bool) -> SegmentResult:
    default, default_ms = _default_ms(state, evaluator)
    return SegmentResult(label=state.space.label, family=state.space.family,
                         problem=tuple(state.space.problem), occurrences=state.occurrences,
                         default=default, default_ms=default_ms, best=best, best_ms=best_ms,
                         measured=state.measured, source=source, verified=verified)


def _finish(state: _State, evaluator: Evaluator, reporter: Reporter,
            max_attempts: int = 5) -> SegmentResult:
    """Verify the winner once (falling back to the next best); store it when correct."""
    space = state.space
    for _ in range(max_attempts):
        best = evaluator.best_known(space)
        if best is None:
            break
        config, measurement = best
        if evaluator.verify(space, config):
            evaluator.set_winner(space, config, measurement.score)
            return _result(state, evaluator, config, measurement.time_ms, "measured",
                           verified=True)
        reporter.warning(f"{space.label}: config {config.key} gave a wrong result; "
                         "trying the next best")
        evaluator.mark_fault(space, config, "wrong result")
    reporter.warning(f"{space.label}: no verified config; keeping the analytical default")
    return _result(state, evaluator, None, None, "measured", verified=False)
