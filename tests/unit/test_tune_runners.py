"""The tuner's real-kernel side without a GPU: spaces, compile path, runner refusal, tune_plan.

* Every family's :class:`~stofc.tune.spaces.KernelSegment` on BERT-base shapes
  at (16, 2048) with a BigBird mask: pruned, non-empty, the plan's analytical
  default among the configs, stable keys, problem keys that change with what
  changes the answer (tokens, dtype, mask, arch).
* ``compile_candidate`` compiles a candidate of each family into the cache.
* The runners refuse cleanly (one-line DeviceError) where no GPU exists.
* ``tune_plan`` with a simulated measurer writes the verified winners back
  into the plan's KernelSpecs, per length bucket, and a warm database answers
  a second run without measuring.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest

from stofc.errors import DeviceError, PlanError
from stofc.masks import encode
from stofc.plan.build import build_plan, plan_layer
from stofc.plan.families import match_segments
from stofc.plan.moves import merge
from stofc.plan.plan import Plan
from stofc.plan.scheme import FusionScheme
from stofc.plan.synthetic import bert_layer
from stofc.targets import get_profile
from stofc.tune.db import TuningDatabase
from stofc.tune.interfaces import Config, Measurement, SegmentSpace, segment_key
from stofc.tune.measure import MeasureTask
from stofc.tune.plan_tuner import tune_plan, tune_plan_buckets
from stofc.tune.progress import RecordingReporter
from stofc.tune.spaces import SpaceFactory, config_of_spec

BIGBIRD = "bigbird:block=64,window=3,global=2,random=3"
H100 = get_profile("h100")


@pytest.fixture(scope="module")
def bert():
    layer = bert_layer(768, 12, 3072)
    fmt = encode(BIGBIRD, 2048, tile=64)
    plan = build_plan([layer], fmt, H100, dtype="float16", max_seq_len=2048, batch=16)
    return layer, fmt, plan


def _factory(layer, fmt, plan, **kw):
    lp = plan.layers[0]
    args = {"batch": 16, "seq_len": 2048, "dtype": "float16", "profile": H100, "mask": fmt,
            "qkv_store": "row", "defaults": tuple((s.ops, s.kernel) for s in lp.segments)}
    args.update(kw)
    return SpaceFactory(layer, **args)


def test_bert_base_spaces_are_pruned_nonempty_and_hold_the_plans_defaults(bert):
    layer, fmt, plan = bert
    lp = plan.layers[0]
    factory = _factory(layer, fmt, plan)
    families = set()
    for seg, match in zip(lp.segments, match_segments(layer, lp.scheme), strict=True):
        space = factory(match)
        assert isinstance(space, SegmentSpace)
        configs = space.configs()
        assert configs, f"{space.label}: no config survived pruning"
        assert len({c.key for c in configs}) == len(configs)
        assert space.default_config() in configs
        families.add(space.family)
        if space.family == "attention":
            kinds = {c["kind"] for c in configs}
            # Hopper (the default target) adds the warp-specialised kernel
            assert kinds == {"block", "row", "ws"}
            assert all(c["mma"] == "wgmma" for c in configs if c["kind"] == "ws")
            assert fmt.spec_hash in space.problem and 16 in space.problem
            spec = space.kernel_spec(space.default_config())
            assert spec.template.startswith("attention/") and spec.param("dtype") == "float16"
            assert spec.param("has_key_bits") is False   # bert_layer: no padding input
        else:
            assert space.prune_reasons(), f"{space.label}: nothing pruned (no constraint ran)"
            assert sum(space.prune_reasons().values()) > 0
            # the default is exactly the plan's analytical kernel
            assert space.kernel_spec(space.default_config()) == seg.kernel
            impls = {c["impl"] for c in configs}
            assert impls == {"cublas", "mma"}   # the vendor candidate competes
            assert {c["lt"] for c in configs if c["impl"] == "cublas"} == {True, False}
            assert 16 * 2048 in space.problem and "float16" in space.problem
        assert "sm_90" in space.problem and space.compile_options[-1] == "sm_90"
        for config in (configs[0], configs[-1], space.default_config()):
            assert config_of_spec(space.kernel_spec(config)) == config
    assert families == {"gemm", "gemm_norm", "attention"}


def test_keys_are_stable_and_change_with_what_changes_the_answer(bert):
    layer, fmt, plan = bert
    lp = plan.layers[0]
    matches = match_segments(layer, lp.scheme)

    def keys(factory):
        return [(segment_key(s), [c.key for c in s.configs()])
                for s in (factory(m) for m in matches)]

    base = keys(_factory(layer, fmt, plan))
    assert keys(_factory(layer, fmt, plan)) == base            # deterministic, stable
    for other in (
        _factory(layer, fmt, plan, dtype="bfloat16"),
        _factory(layer, fmt, plan, batch=8),
        _factory(layer, fmt, plan, profile=get_profile("a100")),
        _factory(layer, encode("bigbird:block=64,window=3,global=2,random=2", 2048), plan),
    ):
        changed = [a[0] != b[0] for a, b in zip(base, keys(other), strict=True)]
        assert any(changed)
    mask_changed = keys(_factory(layer, encode("sliding:window=256", 2048), plan))
    assert base[1][0] != mask_changed[1][0]                     # attention key holds the mask
    assert base[0][0] == mask_changed[0][0]                     # the GEMMs' do not


def test_every_family_has_a_space_add_norm_gemm_gemm_and_the_head_store(bert):
    layer, fmt, plan = bert
    n = len(layer.chain)
    unfused = FusionScheme.unfused(n)
    ffn = plan.layers[0].scheme
    ffn_seg = ffn.segment_of(next(i for i, o in enumerate(layer.chain) if o.role == "ffn_in"))
    chain = merge(ffn, ffn_seg)
    factory = _factory(layer, fmt, plan, batch=1, seq_len=128, defaults=())
    seen = {}
    for scheme in (unfused, chain):
        for match in match_segments(layer, scheme):
            space = factory(match)
            seen.setdefault(space.family, space)
    assert {"add_norm", "gemm_gemm", "gemm", "attention"} <= set(seen)
    for family in ("add_norm", "gemm_gemm"):
        space = seen[family]
        assert space.configs() and space.default_config() in space.configs()
        assert config_of_spec(space.kernel_spec(space.default_config())) == \
            space.default_config()
    heads = _factory(layer, fmt, plan, qkv_store="heads", defaults=())
    qkv = heads(match_segments(layer, plan.layers[0].scheme)[0])
    assert {c["impl"] for c in qkv.configs()} == {"mma"}       # no vendor path for heads
    assert "heads" in qkv.problem
    attn = heads(match_segments(layer, plan.layers[0].scheme)[1])
    assert "bhsd" in attn.problem


def test_compile_candidate_fills_the_kernel_cache(bert, tmp_path, monkeypatch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from stofc.tune.runners import compile_candidate

    monkeypatch.setenv("STOFC_CACHE_DIR", str(tmp_path))
    layer, fmt, plan = bert
    factory = _factory(layer, fmt, plan)
    spaces = [factory(m) for m in match_segments(layer, plan.layers[0].scheme)]
    picked = [(spaces[0], next(c for c in spaces[0].configs() if c["impl"] == "mma")),
              (spaces[2], next(c for c in spaces[2].configs() if c["impl"] == "cublas"
                               and not c["lt"])),
              (spaces[1], spaces[1].default_config())]
    for space, config in picked:
        before = set(tmp_path.rglob("*.cubin.entry"))
        compile_candidate(space.payload, config.key)
        assert set(tmp_path.rglob("*.cubin.entry")) - before, f"{space.label}: nothing compiled"


def _has_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.skipif(_has_gpu(), reason="checks the refusal where no GPU exists")
def test_runners_refuse_cleanly_without_a_gpu(bert):
    from stofc.tune import runners

    layer, fmt, plan = bert
    space = _factory(layer, fmt, plan)(match_segments(layer, plan.layers[0].scheme)[0])
    task = MeasureTask("time", space.family, space.problem, space.default_config().key,
                       space.payload)
    for call in (lambda: runners.run(task), runners.describe):
        with pytest.raises(DeviceError) as err:
            call()
        assert "\n" not in str(err.value) and "GPU" in str(err.value)
    measurer = runners.gpu_measurer(compile_workers=1)
    try:
        with pytest.raises(DeviceError) as err:
            _ = measurer.gpu
        assert "\n" not in str(err.value)
    finally:
        measurer.close()


class TableMeasurer:
    """Deterministic simulated times from a hash of (segment, config); records calls."""

    gpu, driver = "SIM GPU", "0.0"

    def __init__(self) -> None:
        self.calls = 0
        self.verified: list[tuple[str, str]] = []

    def time(self, segment, config) -> float:
        h = zlib.crc32(repr((segment.family, segment.problem, config.key)).encode())
        return 0.05 * len(segment.problem) * (1.0 + (h % 1000) / 1000.0)

    def measure(self, segment, config):
        self.calls += 1
        return Measurement(self.time(segment, config))

    def verify(self, segment, config) -> bool:
        self.verified.append((segment.label, config.key))
        return True


@pytest.fixture(scope="module")
def small():
    layers = [bert_layer(256, 4, 1024, index=i) for i in range(3)]
    fmt = encode(BIGBIRD, 512, tile=64)
    plan = build_plan(layers, fmt, H100, dtype="float16", max_seq_len=512, batch=2)
    return layers, fmt, plan


def test_tune_plan_writes_the_verified_winners_into_every_bucket(small, tmp_path):
    layers, fmt, plan = small
    measurer = TableMeasurer()
    with TuningDatabase.open(tmp_path / "t.sqlite") as db:
        tuning = tune_plan_buckets(plan, layers, fmt, H100, batch=2, seq_lens=(512, 128),
                                   db=db, measurer=measurer, reporter=RecordingReporter())
    assert [n for n, _ in tuning.plans] == [128, 512]
    assert len(tuning.groups) == 2 and all(g.layers == (0, 1, 2) for g in tuning.groups)
    for group, (n, tuned) in zip(tuning.groups, tuning.plans, strict=True):
        assert group.seq_len == n and tuned.tokens == 2 * n and tuned.max_seq_len == 512
        assert Plan.from_json(tuned.to_json()) == tuned
        winners = {(r.family, tuple(r.problem)): r for r in group.result.stage2.segments}
        specs = [tuple(s.kernel for s in lp.segments) for lp in tuned.layers]
        assert specs[0] == specs[1] == specs[2]                 # alike layers share configs
        assert len({lp.scheme for lp in tuned.layers}) == 1
        assert list(tuned.layers[0].scheme.codes) == list(
            FusionScheme.from_values(list(group.result.scheme.values)).codes)
        assert len(group.tuned_segments) == len(tuned.layers[0].segments)
        for timing, seg in zip(group.tuned_segments, tuned.layers[0].segments, strict=True):
            config = Config.from_key(timing.config)
            assert config_of_spec(seg.kernel) == config
            win = [w for (fam, _), w in winners.items() if fam == seg.family
                   and w.best == config]
            assert win and win[0].verified                       # a verified winner
            assert timing.tuned_ms == pytest.approx(win[0].best_ms)
        # tuned <= default (stage 1 keeps only improvements; stage 2 only lowers bests)
        assert group.tuned_chain_ms <= group.default_chain_ms
        # the plan built from the tuned scheme is executable and complete
        plan_layer(layers[0], tuned.layers[0].scheme, tokens=2 * n, profile=H100,
                   dtype="float16")
    first_calls = measurer.calls
    assert first_calls > 0 and measurer.verified
    again = TableMeasurer()                                       # warm database: no GPU
    with TuningDatabase.open(tmp_path / "t.sqlite") as db:
        warm = tune_plan_buckets(plan, layers, fmt, H100, batch=2, seq_lens=(128, 512),
                                 db=db, measurer=again, reporter=RecordingReporter())
    assert again.calls == 0 and warm.stats.measured == 0
    assert all(not g.result.stage1.decisions for g in warm.groups)   # scheme from the database
    assert warm.plans == tuning.plans
    assert tuning.plan_for(100) is tuning.plans[0][1] and tuning.plan_for(300) is tuning.plans[1][1]


def test_tune_plan_returns_the_largest_bucket_and_checks_its_arguments(small):
    layers, fmt, plan = small
    tuned = tune_plan(plan, layers, BIGBIRD, H100, batch=2, seq_lens=(256,),
                      measurer=TableMeasurer())
    assert tuned.tokens == 512 and len(tuned.layers) == 3
    with pytest.raises(PlanError, match="outside"):
        tune_plan(plan, layers, fmt, H100, batch=2, seq_lens=(1024,), measurer=TableMeasurer())
    with pytest.raises(PlanError, match="model layers"):
        tune_plan(plan, layers[:2], fmt, H100, batch=2, measurer=TableMeasurer())
    other = dataclasses.replace(layers[1], norm_order="pre")
    tuning = tune_plan_buckets(plan, [layers[0], other, layers[2]], fmt, H100, batch=2,
                               measurer=TableMeasurer())
    assert sorted(g.layers for g in tuning.groups) == [(0, 2), (1,)]


def test_tune_package_rewrites_the_package_with_the_tuned_plan(tmp_path, monkeypatch):
    """stofc tune's path on CPU: simulated times, the real package rewrite, still correct."""
    import json
    import sys
    from pathlib import Path

    import onnx

    from stofc.package.load import read_plan
    from stofc.package.manifest import check_manifest
    from stofc.package.verify import verify_package
    from stofc.pipeline import Instruments, compile_model, tune_package

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from build_model import build_model

    model = tmp_path / "model.onnx"
    onnx.save(build_model(layers=2), str(model))
    pkg = compile_model(model, "longformer:window=8,global=2", max_seq_len=128,
                        out_dir=tmp_path / "pkg", instruments=Instruments(progress=False))
    before = read_plan(pkg)
    monkeypatch.setattr("stofc.tune.plan_tuner.gpu_measurer", lambda **kw: TableMeasurer())
    profile = get_profile(before.gpu)
    with TuningDatabase.open(tmp_path / "t.sqlite") as db:
        tune_package(pkg, profile, db, RecordingReporter(), budget_s=None, batch=2,
                     seq_lens=(128,))
    after = read_plan(pkg)
    doc = json.loads((pkg / "plan.json").read_text())
    assert doc["provenance"]["tuned"] is True
    check_manifest(pkg)                                     # rewritten whole, hashes match
    assert after.tokens == 2 * 128 and len(after.layers) == len(before.layers)
    assert after != before
    # the package's plan is what tune_plan chooses with the same (deterministic) measurer
    from stofc.frontend import load_model
    from stofc.masks import load as load_format

    formats = {int(layer): load_format(pkg / e["npz"]) for e in doc["mask"]["formats"]
               for layer in e["layers"]}
    expect = tune_plan(before, load_model(model, pack_projections=True), formats, profile,
                       batch=2, seq_lens=(128,), measurer=TableMeasurer())
    for got, want in zip(after.layers, expect.layers, strict=True):
        assert got.scheme == want.scheme
        for gs, ws in zip(got.segments, want.segments, strict=True):
            if gs.family == "attention":
                assert all(gs.kernel.param(k) == ws.kernel.param(k)
                           for k in ("kind", "tile", "warp_m", "warps", "stages", "q_split"))
            else:
                assert gs.kernel == ws.kernel
    assert verify_package(pkg, cases=[(2, 100)]).passed     # and it still computes the model
