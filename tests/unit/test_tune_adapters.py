"""The engine driven through the adapters over the plan module's real moves (simulated costs)."""

from __future__ import annotations

import pytest

from stofc.tune.adapters import DeclaredSegment, LayerSchemeSpace
from stofc.tune.engine import tune_chain
from stofc.tune.evaluate import Evaluator
from stofc.tune.interfaces import Config, SegmentSpace
from stofc.tune.progress import RecordingReporter
from stofc.tune.stage1 import ci_violations
from tests.tune_simulate import SimChain, SimClock, SimMeasurer, SimOp, SimSegment


class ListSpace:
    """The declared-space duck type: configs() as dicts, explain() with "valid"."""

    def configs(self):
        return [{"bm": bm, "stages": s} for bm in (32, 64) for s in (2, 3) if bm * s <= 128]

    def explain(self):
        return {"valid": 3, "shared memory": 1}


def test_declared_segment_wraps_a_declared_space():
    seg = DeclaredSegment("gemm", (2048, 768, 768), ListSpace(), {"stages": 2, "bm": 64},
                          label="ops 3-6 gemm_norm", compile_options=("-arch=sm_90",))
    assert isinstance(seg, SegmentSpace)
    assert seg.configs() == [Config.of(bm=32, stages=2), Config.of(bm=32, stages=3),
                             Config.of(bm=64, stages=2)]
    assert seg.default_config() in seg.configs()
    assert seg.prune_reasons() == {"shared memory": 1}


def test_declared_segment_over_the_kernels_space():
    space_mod = pytest.importorskip("stofc.kernels.space")

    def constraint(env):
        space_mod.check(env["bm"] * env["stages"] <= 128, "pipeline too large")

    space = space_mod.Space(axes=(("bm", (32, 64, 128)), ("stages", (2, 3))),
                            constraints=(constraint,))
    seg = DeclaredSegment("gemm", (1, 2), space, {"bm": 32, "stages": 2}, label="x")
    assert len(seg.configs()) == 3 and seg.prune_reasons() == {"pipeline too large": 3}


def test_engine_drives_the_plan_modules_moves_on_a_bert_layer():
    synthetic = pytest.importorskip("stofc.plan.synthetic")
    families = pytest.importorskip("stofc.plan.families")
    pytest.importorskip("stofc.plan.moves")
    from stofc.frontend.types import OpKind
    from stofc.plan.scheme import FusionScheme

    layer = synthetic.bert_layer()

    def kind(op):
        return {OpKind.GEMM: "gemm", OpKind.ATTENTION: "attention"}.get(op.kind, "mi")

    cost = {"gemm": 1.0, "attention": 2.0, "mi": 0.2}
    chain = SimChain(tuple(SimOp(f"{op.role}:{kind(op)}", kind(op), cost[kind(op)])
                           for op in layer.chain), tokens=2048)
    space = LayerSchemeSpace(layer, tokens=2048,
                             segment_space=lambda match: SimSegment(chain, match.ops))
    clock = SimClock()
    measurer = SimMeasurer(clock=clock)
    evaluator = Evaluator(measurer, clock=clock)
    result = tune_chain(space, measurer, RecordingReporter(), evaluator=evaluator, per_round=24)
    # The chosen scheme is executable by the plan module and obeys the two-CI rule.
    families.match_segments(layer, FusionScheme.from_values(list(result.scheme.values)))
    assert not ci_violations(result.scheme, space.compute_intensive)
    assert result.stage1.decisions  # the plan's moves were judged
    assert {d.move.kind for d in result.stage1.decisions} <= {"expand", "seize", "compete",
                                                               "split"}
    keys = evaluator.stats.measured_keys
    assert len(keys) == len(set(keys)) == measurer.calls
    assert all(s.verified for s in result.stage2.segments)
