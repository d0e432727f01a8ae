"""The tuner's GPU runners on real kernels: every family times and verifies; faults are data.

BERT-base shapes (hidden 768, 12 heads, FFN 3072) at batch 2 x 512 tokens with
a BigBird mask, through the real measurement worker and compile pool
(:func:`stofc.tune.runners.gpu_measurer`). Then ``tune_plan`` end to end on a
2-layer model for two length buckets with a fresh database, and again warm.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from stofc.masks import encode
from stofc.plan.build import build_plan
from stofc.plan.families import match_segments
from stofc.plan.moves import initial_scheme, merge
from stofc.plan.scheme import FusionScheme
from stofc.plan.synthetic import bert_layer
from stofc.targets import detect
from stofc.tune import runner_attention
from stofc.tune.db import TuningDatabase
from stofc.tune.interfaces import Config
from stofc.tune.measure import MeasureTask
from stofc.tune.plan_tuner import tune_plan_buckets
from stofc.tune.progress import RecordingReporter
from stofc.tune.runners import gpu_measurer
from stofc.tune.spaces import SpaceFactory

BIGBIRD = "bigbird:block=64,window=3,global=2,random=3"


@pytest.fixture(scope="module")
def setup():
    profile = detect()
    layer = bert_layer(768, 12, 3072)
    fmt = encode(BIGBIRD, 512, tile=64)
    plan = build_plan([layer], fmt, profile, dtype="float16", max_seq_len=512, batch=2)
    factory = SpaceFactory(layer, 2, 512, "float16", profile, fmt, "row",
                           tuple((s.ops, s.kernel) for s in plan.layers[0].segments))
    default = plan.layers[0].scheme     # 1024 tokens: norms unfused (add_norm segments)
    fused = initial_scheme(layer, tokens=1024)   # norms fused into the GEMMs (gemm_norm)
    ffn = default.segment_of(next(i for i, o in enumerate(layer.chain) if o.role == "ffn_in"))
    spaces = {}
    for scheme in (default, fused, FusionScheme.unfused(len(layer.chain)), merge(default, ffn)):
        for match in match_segments(layer, scheme):
            space = factory(match)
            spaces.setdefault(space.family, space)
    assert {"gemm", "gemm_norm", "attention", "add_norm", "gemm_gemm"} <= set(spaces)
    measurer = gpu_measurer(timeout_s=60.0)
    yield profile, layer, fmt, spaces, measurer
    measurer.close()


def _picks(space) -> list[Config]:
    configs = list(space.configs())
    out = [space.default_config()]
    for want in ({"impl": "mma"}, {"impl": "cublas", "lt": False}, {"kind": "row"},
                 {"kind": "block", "q_split": 2}):
        found = [c for c in configs if all(c.get(k) == v for k, v in want.items())]
        if found and found[len(found) // 2] not in out:
            out.append(found[len(found) // 2])
    if len(out) == 1:
        out.append(configs[len(configs) // 2])
    return out


@pytest.mark.parametrize("family", ["gemm", "gemm_norm", "attention", "add_norm", "gemm_gemm"])
def test_each_family_times_and_matches_the_float64_reference(setup, family):
    _, _, _, spaces, measurer = setup
    space = spaces[family]
    picks = _picks(space)
    results = measurer.measure_batch(space, picks)
    for config, m in zip(picks, results, strict=True):
        assert m.ok, f"{space.label} {config.key}: {m.fault}"
        assert 0.0005 < m.time_ms < 100.0
        assert measurer.verify(space, config), f"{space.label} {config.key}: wrong result"
    again = measurer.measure(space, picks[0])
    assert again.ok
    if results[0].time_ms > 0.02:                       # repeatable within 25% (not launch-sized)
        assert abs(again.time_ms / results[0].time_ms - 1) < 0.25, (
            f"{space.label} {picks[0].key}: batch {results[0].time_ms:.4f} ms, "
            f"alone {again.time_ms:.4f} ms")


def test_rejected_and_wrong_configs_are_recorded_not_fatal(setup):
    _, _, _, spaces, measurer = setup
    attn = spaces["attention"]
    bad = attn.default_config().replace(stages=9)
    m = measurer.measure(attn, bad)
    assert not m.ok and m.fault.startswith(("rejected", "compile error"))
    norm = spaces["gemm_norm"]
    seg = dataclasses.replace(norm.payload.segment, epsilon=1.0)   # the layer says 1e-5
    wrong = dataclasses.replace(norm, payload=dataclasses.replace(norm.payload, segment=seg),
                                problem=(*norm.problem, "eps=1"))
    assert not measurer.verify(wrong, wrong.default_config())      # the check can fail
    after = measurer.measure(norm, norm.default_config())           # and nothing is poisoned
    assert after.ok


def test_tune_plan_end_to_end_cold_then_warm(setup, tmp_path):
    profile = setup[0]
    layers = [bert_layer(768, 12, 3072, index=i) for i in range(2)]
    fmt = encode(BIGBIRD, 256, tile=64)
    plan = build_plan(layers, fmt, profile, dtype="float16", max_seq_len=256, batch=2)
    with TuningDatabase.open(tmp_path / "tune.sqlite") as db:
        cold = tune_plan_buckets(plan, layers, fmt, profile, batch=2, seq_lens=(128, 256),
                                 budget_s=16, db=db, reporter=RecordingReporter())
    # (one failure in a full tests/gpu run on 2026-11-24 passed alone and on rerun; every
    # assertion says what it saw, so a recurrence can be diagnosed from the log)
    assert cold.stats.measured > 10, cold.stats
    for group in cold.groups:
        why = (f"L={group.seq_len} default {group.default_scheme} {group.default_chain_ms} ms "
               f"{group.default_segments}; tuned {group.tuned_scheme} {group.tuned_chain_ms} ms "
               f"{group.tuned_segments}; stage 1 {group.result.stage1.stopped}")
        assert group.layers == (0, 1), why
        assert group.tuned_chain_ms is not None and group.default_chain_ms is not None, why
        assert group.tuned_chain_ms <= group.default_chain_ms, why
        assert all(t.verified for t in group.tuned_segments), why
    started = time.monotonic()
    with TuningDatabase.open(tmp_path / "tune.sqlite") as db:
        warm = tune_plan_buckets(plan, layers, fmt, profile, batch=2, seq_lens=(128, 256),
                                 budget_s=16, db=db, reporter=RecordingReporter())
    stops = [g.result.stage1.stopped for g in cold.groups]
    if all(s == "converged" for s in stops):
        assert warm.stats.measured == 0, (warm.stats, stops)  # all from the database
        assert warm.plans == cold.plans
        assert time.monotonic() - started < 15, time.monotonic() - started
    else:                                               # stage 1 was cut: it goes on, once
        assert warm.stats.measured < cold.stats.measured, (warm.stats, cold.stats, stops)


def test_attention_runner_measures_and_checks_the_bias_softcap_kernel():
    """A layer with a relative-position bias and soft-capped scores: the runner times and
    verifies that kernel variant (bias and cap in the launch and in the float64
    reference), not the bias-free one."""
    profile = detect()
    layer = bert_layer(768, 12, 3072)
    layer = dataclasses.replace(layer, attention=dataclasses.replace(
        layer.attention, mask_form="relative_bias", bias_input="position_bias", softcap=50.0))
    fmt = encode("causal", 512, tile=64)
    factory = SpaceFactory(layer, 2, 512, "float16", profile, fmt, "row")
    unfused = FusionScheme.unfused(len(layer.chain))
    space = next(factory(m) for m in match_segments(layer, unfused) if m.family == "attention")
    p = space.payload
    assert p.bias and p.softcap
    config = space.default_config()
    task = MeasureTask("verify", space.family, space.problem, config.key, p)
    assert runner_attention.run(task) is True
    ms = runner_attention.run(dataclasses.replace(task, mode="time"))
    assert 0.0005 < ms < 100.0
    op = runner_attention._op(p, runner_attention.attention_config(config))
    assert (True, False, True) in op._kernels, list(op._kernels)  # (bias, key bits, cap)
    assert (False, False, False) not in op._kernels
    # the bias and the cap change the output: the check above compared against them
    q, k, v, out = runner_attention._inputs(task, p)[0]
    with_both = out.copy()
    op.run(q, k, v, out, layout=p.layout, scale=p.scale)
    assert float(abs(out.astype("float32") - with_both.astype("float32")).max()) > 1e-2
