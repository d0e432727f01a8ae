"""The two-stage search on the deterministic simulated cost model (no GPU)."""

from __future__ import annotations

import io
import json

import pytest

from stofc.tune.db import TuningDatabase
from stofc.tune.engine import tune_chain
from stofc.tune.evaluate import Evaluator, sample_configs
from stofc.tune.interfaces import Config, Scheme
from stofc.tune.progress import JsonReporter, RecordingReporter
from stofc.tune.stage1 import ci_violations, search_scheme, segment_estimate
from stofc.tune.stage2 import neighbours, search_params, share_budget
from tests.tune_simulate import (
    SimClock,
    SimMeasurer,
    SimSchemeSpace,
    SimSegment,
    bert_like_chain,
    boundary_moves,
    faults,
)


def setup(ci_pair_factor: float = 1.3, *, seed: int = 0, propose_illegal: bool = False,
          db: TuningDatabase | None = None, wrong: frozenset[str] = frozenset()):
    clock = SimClock()
    measurer = SimMeasurer(seed=seed, clock=clock, wrong=wrong)
    space = SimSchemeSpace(bert_like_chain(ci_pair_factor=ci_pair_factor),
                           propose_illegal=propose_illegal)
    return space, measurer, Evaluator(measurer, db, clock=clock)


def assert_measured_once(evaluator: Evaluator) -> None:
    keys = evaluator.stats.measured_keys
    assert len(keys) == len(set(keys)) == evaluator.stats.measured


# ---- interfaces ---------------------------------------------------------------------------

def test_config_is_an_order_free_frozen_mapping():
    a = Config.of({"warps": 4, "block_m": 64})
    b = Config.of(block_m=64, warps=4)
    assert a == b and hash(a) == hash(b) and a.key == '{"block_m":64,"warps":4}'
    assert Config.from_key(a.key) == a and dict(a) == {"block_m": 64, "warps": 4}
    assert a.replace(warps=8)["warps"] == 8 and a["warps"] == 4
    with pytest.raises(TypeError):
        Config.of(tile=(64, 64))


def test_scheme_segments_and_canonical_form():
    s = Scheme((0, 1, 0, 0, 0, 1, 1))
    assert s.segments() == ((0,), (1,), (2, 3, 4), (5, 6))
    assert Scheme((5, 7, 3, 3, 3, 9, 9)).canonical() == s.canonical()
    assert str(s) == "0 1 [0 0 0] [1 1]"
    with pytest.raises(ValueError):
        Scheme.from_segments([[0], [2]])


def test_reference_moves_respect_the_rules():
    chain = bert_like_chain()
    is_ci = [op.kind in ("gemm", "attention") for op in chain.ops]
    space = SimSchemeSpace(chain)
    scheme = Scheme.from_segments([[0, 1], [2], [3, 4, 5, 6], [7, 8, 9], [10], [11, 12, 13]])
    moves = boundary_moves(scheme, is_ci, space.fixed)
    kinds = {m.kind for m in moves}
    assert kinds == {"expand", "seize"}
    for move in moves:
        assert not ci_violations(move.result, space.compute_intensive)
        assert move.result.segment_of(2) == (2,)  # attention never moves
    seize = [m for m in moves if m.kind == "seize"]
    assert any(m.result.segment_of(10) == (10, 11) for m in seize)
    compete = boundary_moves(Scheme.from_segments([[0, 1], [2], [3], [4], [5, 6, 7], *(
        [[i] for i in range(8, 14)])]), is_ci, space.fixed)
    assert all(m.kind != "compete" or m.ops == (4,) for m in compete)


# ---- stage 1 ------------------------------------------------------------------------------

def test_stage1_keeps_improving_moves_and_rolls_back_worsening_ones():
    space, measurer, evaluator = setup(ci_pair_factor=1.3)
    result = search_scheme(space, evaluator, RecordingReporter(), samples_per_segment=4)
    kept = [d for d in result.decisions if d.kept]
    rolled = [d for d in result.decisions if not d.kept]
    assert kept and rolled
    for d in kept:
        assert d.after_ms < d.before_ms * 0.98
    for d in rolled:
        assert d.after_ms >= d.before_ms * 0.98
    # The chosen scheme's sampled cost is the sum of its segments' estimates, and lower.
    initial = sum(segment_estimate(evaluator, s, 4, 0) for s in space.segments(result.initial))
    final = sum(segment_estimate(evaluator, s, 4, 0) for s in space.segments(result.scheme))
    assert final == pytest.approx(result.cost_ms) and final < initial * 0.9
    # Fusing two GEMMs costs 1.3x here: stage 1 must never keep such a segment.
    assert all(sum(i in space.compute_intensive for i in g) <= 1 for g in result.scheme.segments())
    # Memory-bound ops next to GEMMs get fused (the model makes that 85% cheaper).
    assert any(len(g) > 1 and space.compute_intensive & set(g) for g in result.scheme.segments())
    assert result.scheme.segment_of(2) == (2,)
    assert_measured_once(evaluator)
    assert measurer.calls == evaluator.stats.measured


def test_stage1_fuses_gemm_pairs_when_that_is_faster_and_never_more_than_two():
    space, _, evaluator = setup(ci_pair_factor=0.5, propose_illegal=True)
    result = search_scheme(space, evaluator, RecordingReporter())
    ci_per_segment = [sum(i in space.compute_intensive for i in g) for g in result.scheme.segments()]
    assert max(ci_per_segment) == 2
    refused = [d for d in result.decisions if "compute-intensive" in d.reason]
    assert refused and all(not d.kept for d in refused)
    # Nothing with three CI ops was ever measured.
    for (family, _, _), _ in evaluator.stats.measured_keys:
        assert family.count("gemm") + family.count("attention") <= 2
    assert_measured_once(evaluator)


def test_stage1_survives_a_proposed_scheme_the_space_cannot_execute():
    from stofc.errors import PlanError

    space, _, evaluator = setup()
    segments = space.segments

    def picky(scheme):
        if any(len(g) > 2 for g in scheme.segments()):
            raise PlanError("segment too long for any family")
        return segments(scheme)

    space.segments = picky
    result = search_scheme(space, evaluator, RecordingReporter())
    assert all(len(g) <= 2 for g in result.scheme.segments())
    refused = [d for d in result.decisions if d.reason.startswith("not executable")]
    assert refused and not any(d.kept for d in refused)


def test_stage1_is_deterministic_and_the_memo_answers_repeats():
    runs = []
    for _ in range(2):
        space, _, evaluator = setup(seed=3)
        result = search_scheme(space, evaluator, RecordingReporter())
        runs.append((result.scheme, [d.reason for d in result.decisions], evaluator.stats.measured))
    assert runs[0] == runs[1]
    space, measurer, evaluator = setup()
    seg = space.segments(space.initial())[0]
    assert sample_configs(seg, 4, 0) == sample_configs(seg, 4, 0)
    assert sample_configs(seg, 4, 0)[0] == seg.default_config()
    first = segment_estimate(evaluator, seg, 4, 0)
    calls = measurer.calls
    assert segment_estimate(evaluator, seg, 4, 0) == first and measurer.calls == calls


# ---- stage 2 ------------------------------------------------------------------------------

def test_share_budget():
    assert share_budget(12, [0, 0, 0], [True] * 3) == [4, 4, 4]
    assert share_budget(12, [0.0, 3.0, 1.0], [True] * 3) == [1, 8, 3]  # 9 left: 6.75, 2.25
    assert share_budget(12, [5.0, 0, 0], [True, False, True]) == [11, 0, 1]
    assert share_budget(2, [1.0, 1.0, 1.0], [True] * 3) == [1, 1, 0]


def test_neighbours_move_one_parameter_one_step():
    seg = SimSegment(bert_like_chain(), (0,))
    configs = set(seg.configs())
    best = Config.of(block_m=64, block_n=64, warps=4, stages=2)
    found = neighbours(best, {"block_m": [16, 32, 64, 128, 256], "block_n": [32, 64, 128, 256],
                              "warps": [1, 2, 4, 8], "stages": [1, 2, 3, 4]}, configs)
    assert all(sum(best[p] != c[p] for p in best) == 1 for c in found)
    assert best.replace(block_m=32) in found and best.replace(block_m=16) not in found


def test_stage2_finds_the_known_optimum_within_budget_and_shifts_budget():
    space, measurer, evaluator = setup()
    segments = list(space.segments(Scheme.from_segments(
        [[0, 1], [2], [3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13]])))
    reporter = RecordingReporter()
    result = search_params(segments, evaluator, reporter, per_round=20, seed=0)
    assert result.stopped == "converged"
    total_space = sum(len(s.configs()) for s in segments)
    assert evaluator.stats.measured < total_space / 3  # far from exhaustive
    for seg, res in zip(segments, result.segments, strict=True):
        best, best_ms = measurer.true_best(seg)
        assert res.best == best and res.best_ms == best_ms and res.verified
        assert not faults(res.best)
        assert res.default_ms is not None and res.default_ms >= res.best_ms
    assert evaluator.stats.faults > 0  # the faulting region was sampled and survived
    # Round 0 is equal; afterwards the segment that gained most gets the largest share,
    # and a segment that gained nothing gets only the floor of one.
    assert len(set(result.allocations[0])) == 1
    for r in range(1, len(result.allocations)):
        gains, shares = result.gains[r - 1], result.allocations[r]
        if max(gains) > 0:
            top = max(range(len(gains)), key=lambda i: gains[i])
            assert shares[top] == max(shares)
            assert all(shares[i] <= 1 for i, g in enumerate(gains) if g == 0)
    assert sum(sum(a) for a in result.allocations) >= evaluator.stats.measured - len(segments)
    (stage,) = reporter.of_kind("stage")
    assert stage[0] == "stage 2" and f"{total_space} candidates after analytical pruning" in stage[1]
    assert f"({5 * sum(segments[0].prune_reasons().values())} pruned)" in stage[1]
    progress = reporter.of_kind("progress")
    done = [p.done for p in progress]
    assert done == sorted(set(done)) and done[-1] == sum(r.measured for r in result.segments)
    assert all(p.stage == "stage 2" and p.planned >= p.done for p in progress)
    assert_measured_once(evaluator)


def test_stage2_is_deterministic_for_a_seed():
    runs = []
    for seed in (5, 5, 6):
        space, _, evaluator = setup(seed=0)
        segments = list(space.segments(space.initial()))
        result = search_params(segments, evaluator, RecordingReporter(), per_round=16, seed=seed)
        runs.append((result.allocations, [s.best for s in result.segments],
                     evaluator.stats.measured_keys))
    assert runs[0] == runs[1]
    assert runs[0][2] != runs[2][2]  # another seed samples differently


def test_stage2_merges_equal_segments_and_weighs_them():
    space, _, evaluator = setup()
    seg = space.segments(space.initial())[0]
    result = search_params([seg, seg, seg], evaluator, RecordingReporter(), per_round=8)
    assert len(result.segments) == 1 and result.segments[0].occurrences == 3


def test_stage2_stops_at_the_deadline():
    space, measurer, evaluator = setup()
    segments = list(space.segments(space.initial()))
    result = search_params(segments, evaluator, RecordingReporter(), deadline=1.0)
    assert result.stopped == "deadline"
    assert measurer.clock.now <= 1.0 + measurer.seconds_per_measure * 1.01


def test_a_wrong_winner_is_replaced_by_the_next_verified_one():
    space, measurer, _ = setup()
    seg = space.segments(space.initial())[0]
    best, _ = measurer.true_best(seg)
    space, measurer, evaluator = setup(wrong=frozenset({best.key}))
    reporter = RecordingReporter()
    result = search_params([seg], evaluator, reporter, per_round=16)
    res = result.segments[0]
    assert res.best != best and res.verified
    assert measurer.verified[0] == (seg.label, best.key) and measurer.verified[1][1] == res.best.key
    assert any("wrong result" in w for w in reporter.of_kind("warning"))


# ---- the whole engine, database and warm cache --------------------------------------------

def test_cold_then_warm_run_measures_nothing_the_second_time(tmp_path):
    path = tmp_path / "tuning.sqlite"
    with TuningDatabase.open(path) as db:
        space, measurer, evaluator = setup(db=db)
        cold = tune_chain(space, measurer, RecordingReporter(), db=db, evaluator=evaluator)
        assert measurer.calls > 0
        assert_measured_once(evaluator)
    with TuningDatabase.open(path) as db:
        space, measurer, evaluator = setup(db=db)
        reporter = RecordingReporter()
        warm = tune_chain(space, measurer, reporter, db=db, evaluator=evaluator)
    assert measurer.calls == 0 and evaluator.stats.measured == 0
    assert measurer.verified == []
    assert warm.scheme == cold.scheme
    assert [s.best for s in warm.stage2.segments] == [s.best for s in cold.stage2.segments]
    assert {s.source for s in warm.stage2.segments} == {"database"}
    (rows,) = reporter.of_kind("summary")
    assert all(r.speedup is not None and r.speedup >= 1.0 for r in rows)


def test_twelve_identical_layers_cost_the_measurements_of_one():
    space, measurer, evaluator = setup()
    first = tune_chain(space, measurer, RecordingReporter(), evaluator=evaluator)
    calls = measurer.calls
    for _ in range(11):
        again = tune_chain(SimSchemeSpace(bert_like_chain()), measurer, RecordingReporter(),
                           evaluator=evaluator)
        assert again.scheme == first.scheme
        assert [s.best for s in again.stage2.segments] == [s.best for s in first.stage2.segments]
    assert measurer.calls == calls
    assert len(measurer.verified) == len(first.stage2.segments)


def test_time_budget_bounds_the_whole_run():
    space, measurer, evaluator = setup()
    result = tune_chain(space, measurer, RecordingReporter(), budget_s=3.0, evaluator=evaluator)
    assert measurer.clock.now <= 3.0 + 2 * measurer.seconds_per_measure
    assert result.stage2.stopped == "deadline"


def test_json_reporter_emits_one_object_per_line():
    space, measurer, evaluator = setup()
    out = io.StringIO()
    tune_chain(space, measurer, JsonReporter(out), evaluator=evaluator, per_round=16)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    kinds = {e["event"] for e in events}
    assert {"stage", "progress", "summary"} <= kinds
    stages = {e["stage"] for e in events if e["event"] == "progress"}
    assert stages == {"stage 1", "stage 2"}
    summary = events[-1]
    assert summary["event"] == "summary" and summary["segments"]
    assert all(s["speedup"] >= 1.0 for s in summary["segments"])


def test_rich_reporter_prints_stages_and_the_summary_table():
    from rich.console import Console

    from stofc.tune.progress import RichReporter

    space, measurer, evaluator = setup()
    out = io.StringIO()
    result = tune_chain(space, measurer, RichReporter(Console(file=out, width=140)),
                        evaluator=evaluator, per_round=16)
    text = out.getvalue()
    assert "stage 1" in text and "stage 2" in text and "tuning summary" in text
    for row in result.summary_rows():
        assert row.segment in text and f"{row.speedup:.2f}x" in text
