"""cuBLASLt's algorithm as a tuning parameter of vendor GEMM segments (no GPU).

* The real spaces: ``lt_algo`` (heuristic rank 0..7) on cuBLASLt vendor configs
  only, rank 0 the default, ``("lt_algo", r), ("lt_m", M)`` in the KernelSpec
  of a rank other than 0, the problem key carrying the cuBLASLt version.
* The search on the simulated model finds the best rank; ranks the heuristic
  does not return are rejected, never win.
* ``tune_plan`` writes the rank into the plan; the database answers a warm run.
* :class:`~stofc.runtime.segment_cublas.CublasLt` over a fake library: the
  descriptors of the ORT twin, ``rank + 1`` results requested, result ``rank``
  (or the last) used; the segment runner passes ``[K, N]`` weights and applies a
  rank only at its ``lt_m``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import re
import types
import zlib
from pathlib import Path

import numpy as np
import pytest

from stofc.errors import PlanError
from stofc.kernels import catalog
from stofc.kernels.registry import PlanContext
from stofc.kernels.vendor_gemm import LT_ALGO, LT_M
from stofc.masks import encode
from stofc.plan.build import build_plan
from stofc.plan.families import match_segments
from stofc.plan.plan import KernelSpec, Plan
from stofc.plan.scheme import FusionScheme
from stofc.plan.synthetic import bert_layer
from stofc.runtime import segment_cublas as sc
from stofc.targets import get_profile
from stofc.tune.db import TuningDatabase
from stofc.tune.evaluate import Evaluator
from stofc.tune.interfaces import Measurement, segment_key
from stofc.tune.plan_tuner import tune_plan_buckets
from stofc.tune.progress import RecordingReporter
from stofc.tune.spaces import SpaceFactory, config_of_spec
from stofc.tune.stage2 import neighbours, search_params
from tests.tune_simulate import (
    LT_RANKS,
    SimClock,
    SimMeasurer,
    SimSchemeSpace,
    bert_like_chain,
    lt_returned,
)

ROOT = Path(__file__).resolve().parents[2]
BIGBIRD = "bigbird:block=64,window=3,global=2,random=3"
H200 = get_profile("h200")


# ---- the real spaces ------------------------------------------------------------------

@pytest.fixture(scope="module")
def bert():
    layer = bert_layer(768, 12, 3072)
    fmt = encode(BIGBIRD, 2048, tile=64)
    plan = build_plan([layer], fmt, H200, dtype="float16", max_seq_len=2048, batch=16)
    lp = plan.layers[0]
    factory = SpaceFactory(layer, 16, 2048, "float16", H200, fmt, "row",
                           tuple((s.ops, s.kernel) for s in lp.segments))
    spaces = [factory(m) for m in match_segments(layer, lp.scheme)]
    return layer, fmt, plan, factory, spaces


def test_lt_algo_is_a_parameter_of_cublaslt_vendor_configs_only(bert):
    layer, _, plan, _, spaces = bert
    vendor = 0
    for seg, space in zip(plan.layers[0].segments, spaces, strict=True):
        configs = space.configs()
        with_rank = [c for c in configs if LT_ALGO in c]
        assert all(c.get("impl") == "cublas" and c["lt"] is True for c in with_rank)
        lt_configs = [c for c in configs if c.get("impl") == "cublas" and c["lt"] is True]
        assert len(with_rank) == len(lt_configs)          # every cuBLASLt config has a rank
        if not lt_configs:
            continue
        vendor += 1
        assert {c[LT_ALGO] for c in lt_configs} == set(range(8))
        # each epilogue config once per rank
        assert len({c.replace(**{LT_ALGO: 0}) for c in lt_configs}) * 8 == len(lt_configs)
        default = space.default_config()
        assert default[LT_ALGO] == 0                      # the analytical default: rank 0
        assert space.kernel_spec(default) == seg.kernel   # untuned specs are unchanged
        assert LT_ALGO not in dict(seg.kernel.params)
        assert space.unordered == (LT_ALGO,)
    assert vendor == 4                                    # QKV, out, FFN in, FFN out
    # memory-bound, GEMM+GEMM and attention spaces have no rank
    unfused = FusionScheme.unfused(len(layer.chain))
    small = SpaceFactory(layer, 1, 128, "float16", H200, bert[1], "row")
    for match in match_segments(layer, unfused):
        space = small(match)
        if space.family in ("add_norm", "attention"):
            assert all(LT_ALGO not in c for c in space.configs())


def test_a_tuned_rank_is_carried_with_its_m_and_read_back(bert):
    _, _, plan, _, spaces = bert
    space = spaces[0]
    tokens = 16 * 2048
    config = next(c for c in space.configs() if c.get(LT_ALGO) == 3)
    spec = space.kernel_spec(config)
    assert spec.template == "vendor/cublas"
    assert spec.params[-2:] == ((LT_ALGO, 3), (LT_M, tokens))
    assert config_of_spec(spec) == config
    assert config_of_spec(spec, tokens) == config
    assert config_of_spec(spec, 1024)[LT_ALGO] == 0      # tuned for another M: rank 0
    assert Plan.from_json(plan.to_json()) == plan
    vendor = catalog.family("vendor_gemm")
    problem = dict(space.payload.problems)["vendor_gemm"]
    with pytest.raises(PlanError, match="needs the M"):
        vendor.spec(dataclasses.replace(problem, m=0), vendor.from_params(config))
    plain = next(c for c in space.configs() if c.get("impl") == "cublas" and not c["lt"])
    assert LT_ALGO not in plain and LT_ALGO not in dict(space.kernel_spec(plain).params)
    # a plan spec with rank 2 at this M is that segment's default here
    tuned_spec = KernelSpec(spec.family, spec.template, (*spec.params[:-2], (LT_ALGO, 2),
                                                         (LT_M, tokens)))
    assert config_of_spec(tuned_spec, tokens)[LT_ALGO] == 2


def test_gemm_problem_keys_carry_the_cublaslt_version(bert, monkeypatch):
    layer, fmt, plan, _, _ = bert
    matches = match_segments(layer, plan.layers[0].scheme)

    def keys(version):
        monkeypatch.setattr("stofc.kernels.vendor_gemm.lt_version", lambda: version)
        factory = SpaceFactory(layer, 16, 2048, "float16", H200, fmt, "row")
        return {m.ordinal: (factory(m).family, segment_key(factory(m))) for m in matches}

    a, b = keys(130000), keys(130100)
    for ordinal, (family, key) in a.items():
        if family == "attention":
            assert key == b[ordinal][1]
        else:
            assert "cublasLt:130000:w_kn" in key[1] and key != b[ordinal][1]


# ---- the search on the simulated model ------------------------------------------------

def test_unordered_parameters_have_every_value_as_neighbour():
    space = SimSchemeSpace(bert_like_chain(), vendor=True)
    seg = space.segments(space.initial())[0]
    configs = list(seg.configs())
    values = {"impl": ["cublas"], "lt_algo": list(range(LT_RANKS)), "rows": [1, 2, 4, 8]}
    best = seg.default_config()
    ordered = neighbours(best, values, set(configs))
    free = neighbours(best, values, set(configs), seg.unordered)
    assert {c["lt_algo"] for c in ordered if c["rows"] == best["rows"]} == {1}
    assert {c["lt_algo"] for c in free if c["rows"] == best["rows"]} == set(range(1, LT_RANKS))


def _vendor_search(seed: int, **kw):
    clock = SimClock()
    measurer = SimMeasurer(seed=seed, clock=clock)
    space = SimSchemeSpace(bert_like_chain(), vendor=True)
    segments = [s for s in space.segments(space.initial()) if s.vendor]
    evaluator = Evaluator(measurer, clock=clock)
    result = search_params(segments, evaluator, RecordingReporter(), seed=seed, **kw)
    return segments, measurer, evaluator, result


def test_search_finds_the_simulated_best_rank_and_never_a_missing_one():
    segments, measurer, evaluator, result = _vendor_search(0, patience=10**6)
    assert result.stopped == "exhausted"
    assert len(segments) == 4
    nonzero = rejected = 0
    for seg, res in zip(segments, result.segments, strict=True):
        best, best_ms = measurer.true_best(seg)
        assert res.best == best and res.best_ms == pytest.approx(best_ms) and res.verified
        assert res.default["lt_algo"] == 0 and res.best_ms <= res.default_ms
        assert int(res.best["lt_algo"]) < lt_returned(seg.problem)
        nonzero += res.best["lt_algo"] != 0
        memo = evaluator.memo(seg)
        missing = [c for c in seg.configs()
                   if c.get("impl") == "cublas" and c["lt_algo"] >= lt_returned(seg.problem)]
        assert all(memo[c.key].fault.startswith("rejected: cuBLASLt") for c in missing)
        rejected += len(missing)
    assert rejected, "every simulated heuristic returned 8 ranks: nothing was rejected"
    assert nonzero >= 1, "no simulated problem prefers a rank other than 0: the test is moot"


def test_default_budget_reaches_the_best_rank_of_the_vendor_path():
    """With the usual round budget (not exhaustive), every rank of the best epilogue
    config is tried (unordered neighbours), so the vendor path's best rank is found."""
    for seed in (0, 1, 2):
        segments, measurer, _, result = _vendor_search(seed)
        for seg, res in zip(segments, result.segments, strict=True):
            assert res.best.get("impl") == "cublas"
            same_rows = [c for c in seg.configs() if c.get("impl") == "cublas"
                         and c["rows"] == res.best["rows"]]
            times = [measurer.time_ms(seg, c) for c in same_rows]
            fastest = min((t, c.key) for t, c in zip(times, same_rows, strict=True)
                          if t is not None)
            assert res.best.key == fastest[1]


# ---- tune_plan writes the rank; the database answers a warm run --------------------------

def _favourite_rank(problem) -> int:
    return 1 + zlib.crc32(repr(problem).encode()) % 7


class RankMeasurer:
    """cuBLASLt fastest, at a rank other than 0 that depends on the problem; records calls."""

    gpu, driver = "SIM GPU", "0.0"

    def __init__(self) -> None:
        self.calls = 0

    def measure(self, segment, config):
        self.calls += 1
        h = zlib.crc32(repr((segment.family, segment.problem, config.key)).encode())
        base = 1.0 + (h % 1000) / 1000.0
        if config.get("impl") == "cublas" and config.get("lt"):
            base = 0.5 + 0.01 * config["tpr"] / 1024 + 0.01 * config["rows"]
            base *= 0.5 if config[LT_ALGO] == _favourite_rank(segment.problem) else 1.0
        return Measurement(base * 0.01 * len(segment.problem))

    def verify(self, segment, config) -> bool:
        return True


def test_tune_plan_writes_lt_algo_and_lt_m_and_the_database_keeps_them(tmp_path):
    layers = [bert_layer(256, 4, 1024, index=i) for i in range(2)]
    fmt = encode(BIGBIRD, 512, tile=64)
    plan = build_plan(layers, fmt, H200, dtype="float16", max_seq_len=512, batch=2)
    measurer = RankMeasurer()
    with TuningDatabase.open(tmp_path / "t.sqlite") as db:
        tuning = tune_plan_buckets(plan, layers, fmt, H200, batch=2, seq_lens=(512,), db=db,
                                   measurer=measurer, reporter=RecordingReporter())
        tuned = tuning.plan_for(512)
        vendor = [s for lp in tuned.layers for s in lp.segments
                  if s.kernel.template == "vendor/cublas"]
        assert vendor
        group = tuning.groups[0]
        for seg in vendor:
            params = dict(seg.kernel.params)
            assert params["lt"] is True and params[LT_M] == 2 * 512
            winner = [r for r in group.result.stage2.segments
                      if r.family == seg.family and r.best is not None
                      and config_of_spec(seg.kernel) == r.best]
            assert winner, f"{seg.kernel} is no stage-2 winner"
            assert params[LT_ALGO] == _favourite_rank(winner[0].problem)
        records = _records(db)        # the database keeps each winner's rank
        lt_records = [(problem, config) for problem, config in records
                      if config.get("impl") == "cublas" and config.get("lt")]
        assert len(lt_records) >= len({(s.family, s.dims) for s in vendor})
        for problem, config in lt_records:
            assert config[LT_ALGO] == _favourite_rank(tuple(problem))
        assert Plan.from_json(tuned.to_json()) == tuned
    first = measurer.calls
    assert first > 0
    again = RankMeasurer()
    with TuningDatabase.open(tmp_path / "t.sqlite") as db:
        warm = tune_plan_buckets(plan, layers, fmt, H200, batch=2, seq_lens=(512,), db=db,
                                 measurer=again, reporter=RecordingReporter())
    assert again.calls == 0 and warm.plans == tuning.plans


def _records(db: TuningDatabase) -> list[tuple[list, dict]]:
    rows = db._conn.execute("SELECT problem, config FROM records WHERE family != 'scheme'")
    return [(json.loads(problem), json.loads(config)) for problem, config in rows]


# ---- CublasLt over a fake library ---------------------------------------------------------

class FakeLt:
    """Records cuBLASLt calls; the heuristic returns ``available`` results, each marked
    with its index (first 8 bytes) and a workspace size."""

    def __init__(self, available: int) -> None:
        self.available = available
        self.calls: list[tuple] = []
        self.matmuls: list[dict] = []
        self._next = 1000

        def new(ref):
            self._next += 1
            ref._obj.value = self._next
            return 0

        def create(ref):
            self.calls.append(("create",))
            return new(ref)

        def desc_create(ref, compute, scale):
            self.calls.append(("desc", compute, scale))
            return new(ref)

        def desc_set(desc, attr, ptr, size):
            raw = ctypes.string_at(ptr.value, size)
            self.calls.append(("set", attr, int.from_bytes(raw, "little")))
            return 0

        def layout(ref, code, rows, cols, ld):
            self.calls.append(("layout", code, rows, cols, ld))
            return new(ref)

        def pref_create(ref):
            return new(ref)

        def pref_set(pref, attr, ptr, size):
            raw = ctypes.string_at(ptr.value, size)
            self.calls.append(("pref", attr, int.from_bytes(raw, "little")))
            return 0

        def heuristic(handle, desc, a, b, c, d, pref, requested, results, count):
            self.calls.append(("heuristic", requested))
            n = min(requested, self.available)
            for i in range(n):
                blob = i.to_bytes(8, "little") + bytes(56) + (4096 * i).to_bytes(8, "little")
                ctypes.memmove(results.value + 96 * i, blob, len(blob))
            count._obj.value = n
            return 0

        def matmul(handle, desc, alpha, a_ptr, a, b_ptr, b, beta, c_ptr, c, d_ptr, d, algo,
                   workspace, size, stream):
            self.matmuls.append({
                "algo": int.from_bytes(ctypes.string_at(algo.value, 8), "little"),
                "a": a_ptr.value, "b": b_ptr.value, "c": c_ptr.value, "d": d_ptr.value,
                "beta": ctypes.c_float.from_address(beta.value).value,
                "workspace": workspace.value, "size": size})
            return 0

        self.cublasLtCreate = create
        self.cublasLtMatmulDescCreate = desc_create
        self.cublasLtMatmulDescSetAttribute = desc_set
        self.cublasLtMatrixLayoutCreate = layout
        self.cublasLtMatmulPreferenceCreate = pref_create
        self.cublasLtMatmulPreferenceSetAttribute = pref_set
        self.cublasLtMatmulAlgoGetHeuristic = heuristic
        self.cublasLtMatmul = matmul


def _array(shape, ptr):
    return types.SimpleNamespace(shape=shape, data=types.SimpleNamespace(ptr=ptr))


def test_chosen_result_is_the_rank_or_the_last_returned():
    assert sc.chosen_result(0, 1) == 0 and sc.chosen_result(3, 5) == 3
    assert sc.chosen_result(7, 5) == 4 and sc.chosen_result(2, 3) == 2
    with pytest.raises(ValueError):
        sc.chosen_result(-1, 3)
    with pytest.raises(ValueError):
        sc.chosen_result(0, 0)


def test_matmul_requests_rank_plus_one_results_and_uses_number_rank():
    fake = FakeLt(available=5)
    lt = sc.CublasLt(lib=fake, workspace=0x5000)
    m, k, n = 256, 768, 2304
    x, w, out = _array((m, k), 0x1000), _array((k, n), 0x2000), _array((m, n), 0x3000)
    for rank in range(8):
        lt.matmul(x, w, out, "float16", 0, algo_rank=rank)
        requested = [c[1] for c in fake.calls if c[0] == "heuristic"]
        assert requested[-1] == rank + 1
        assert fake.matmuls[-1]["algo"] == min(rank, 4)    # result `rank`, or the last
        assert fake.matmuls[-1]["a"] == 0x2000 and fake.matmuls[-1]["b"] == 0x1000
    heuristics = sum(1 for c in fake.calls if c[0] == "heuristic")
    lt.matmul(x, w, out, "float16", 0, algo_rank=3)          # plans are cached per rank
    assert sum(1 for c in fake.calls if c[0] == "heuristic") == heuristics
    assert lt.plan(m, n, k, 2, 1, 0, 6).returned == 5
    with pytest.raises(sc.LtRankUnavailable, match="returned 5 algorithm"):
        lt.matmul(x, w, out, "float16", 0, algo_rank=5, exact_rank=True)
    lt.matmul(x, w, out, "float16", 0, algo_rank=4, exact_rank=True)   # returned: fine
    with pytest.raises(Exception, match=r"expected \[768, N\]"):
        lt.matmul(x, _array((n, k), 0x2000), out, "float16", 0)


def test_descriptors_are_those_of_the_ort_twin():
    fake = FakeLt(available=3)
    lt = sc.CublasLt(lib=fake, workspace=0x5000)
    m, k, n = 512, 3072, 768
    x, w, out = _array((m, k), 0x1000), _array((k, n), 0x2000), _array((m, n), 0x3000)
    bias, residual = _array((n,), 0x4000), _array((m, n), 0x6000)
    lt.matmul(x, w, out, "bfloat16", 0, bias=bias, epilogue=4, residual=residual, algo_rank=1)
    calls = fake.calls
    assert ("desc", 68, 0) in calls                            # COMPUTE_32F, fp32 scale
    sets = [(c[1], c[2]) for c in calls if c[0] == "set"]
    heuristic_at = next(i for i, c in enumerate(calls) if c[0] == "heuristic")
    bias_at = next(i for i, c in enumerate(calls) if c[0] == "set" and c[1] == 8)
    assert bias_at < heuristic_at                              # bias pointer before it
    assert sets[:4] == [(3, 0), (4, 0), (7, 4), (8, 0x4000)]   # opN, opN, BIAS, bias
    layouts = [c[1:] for c in calls if c[0] == "layout"]
    assert layouts == [(14, n, k, n), (14, k, m, k), (14, n, m, n)]
    assert ("pref", 1, 0) in calls                             # no workspace (LT_WORKSPACE)
    done = fake.matmuls[-1]
    assert done["c"] == 0x6000 and done["d"] == 0x3000 and done["beta"] == 1.0
    assert done["size"] == 0
    # the C++ twins build the same (cuda_lt_gemm.cc, shared by FusedGemm and GatedGemm):
    # opN/opN and these three layouts
    cc = (ROOT / "cuda/ort/cuda_lt_gemm.cc").read_text()
    assert re.search(r"MatrixLayoutCreate\(&p->a, dtype, N, K, N\)", cc)
    assert re.search(r"MatrixLayoutCreate\(&p->b, dtype, K, M, K\)", cc)
    assert re.search(r"MatrixLayoutCreate\(&p->c, out_dtype, N, M, N\)", cc)
    assert re.search(r"kLtTransA, &opn", cc) and re.search(r"kLtTransB, &opn", cc)
    assert re.search(r"MatmulDescCreate\(&p->desc, kLtComputeF32, kCudaR32F\)", cc)
    fused = (ROOT / "cuda/ort/cuda_gemm_norm.cc").read_text()
    assert re.search(r"f32_out \? kCudaR32F : dtype", fused)   # C/D = dtype unless a float y


def test_no_lt_workspace_on_either_side():
    """The heuristic may use no workspace, in Python and in the ORT library alike: with one,
    its first choice for BERT-base's QKV GEMM zeroes it with a memset before every call
    (bench/results/lt-workspace-ab-*); the two preferences must match, or a tuned rank
    names different algorithms in the tuner and the package."""
    assert sc.LT_WORKSPACE == 0
    header = (ROOT / "cuda/ort/cublas_lt.h").read_text()
    found = re.search(r"constexpr uint64_t kLtMaxWorkspace = (\d+)(?:ull)?;", header)
    assert found and int(found.group(1)) == sc.LT_WORKSPACE
    fake = FakeLt(available=1)
    lt = sc.CublasLt(lib=fake)                                 # no CuPy buffer is made
    x, w, out = _array((8, 64), 0x1000), _array((64, 32), 0x2000), _array((8, 32), 0x3000)
    lt.matmul(x, w, out, "float16", 0)
    assert fake.matmuls[-1]["workspace"] is None and fake.matmuls[-1]["size"] == 0
    from stofc.kernels.vendor_gemm import vendor_tag
    assert vendor_tag().endswith(":ws0")                       # tuned ranks of 32 MiB: stale


# ---- the segment runner's vendor path -------------------------------------------------

class _LtRecorder:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def matmul(self, x, w_kn, out, dtype, stream_ptr, **kw):
        self.calls.append({"w_kn": w_kn, "x": x, **kw})


def test_runner_passes_kn_weights_and_applies_a_rank_at_its_m_only(monkeypatch):
    from stofc.plan.build import plan_layer
    from stofc.plan.moves import initial_scheme
    from stofc.runtime import segments as rs

    layer = bert_layer()
    plan = plan_layer(layer, initial_scheme(layer, tokens=256), tokens=256,
                      profile=get_profile("h100"), dtype="float16", vendor=True)
    seg = plan.segments[0]
    assert seg.kernel.template == "vendor/cublas" and seg.epilogues[-1].act == "none"
    vendor = catalog.family_of(seg.kernel)
    problem = vendor.problem(seg, PlanContext(256, "float16", get_profile("h100")))
    tuned = vendor.spec(problem, dataclasses.replace(vendor.config_of(seg.kernel, problem),
                                                     lt_algo=3))
    seg = type(seg)(**{**seg.__dict__, "kernel": tuned})
    shim = types.SimpleNamespace(
        empty=np.empty, zeros=np.zeros, full=np.full, ascontiguousarray=np.ascontiguousarray,
        cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=0)))
    recorder = _LtRecorder()
    monkeypatch.setattr(rs, "_cupy", lambda: shim)
    monkeypatch.setattr("stofc.runtime.executors._cupy", lambda: shim)
    monkeypatch.setattr(rs, "lt_handle", lambda: recorder)
    runner = object.__new__(rs.SegmentRunner)
    runner.compile_only, runner._kn = False, {}
    runner.layer, runner.plan, runner.dtype, runner.arch = layer, plan, "float16", "sm_90"
    runner.storage = np.dtype(np.float16)
    rng = np.random.default_rng(0)
    w_nk = rng.standard_normal((2304, 768)).astype(np.float16)
    runner.params = {seg.binding("w0"): w_nk,
                     seg.binding("b0"): rng.standard_normal(2304).astype(np.float16)}
    runner._dummy, runner.poison, runner.use_lt, runner._modules = np.zeros(8), False, True, []
    runner.lt_exact_rank = True
    runner.kernels = {seg.ordinal: runner._compile(seg)}
    for tokens, rank in ((256, 3), (128, 0)):
        x = rng.standard_normal((tokens, 768)).astype(np.float16)
        runner.run_segment(seg, {seg.binding("x"): x}, batch=1, seq_len=tokens)
        call = recorder.calls[-1]
        assert call["algo_rank"] == rank and call["exact_rank"] is True
        assert call["x"] is x and call["epilogue"] == 4
        assert call["w_kn"].shape == (768, 2304) and call["w_kn"].flags.c_contiguous
        assert np.array_equal(call["w_kn"], w_nk.T)
    assert recorder.calls[0]["w_kn"] is recorder.calls[1]["w_kn"]   # one copy, made once


def test_a_rank_candidate_compiles_without_a_gpu(bert):
    """The compile pool's path (``compile_segment``) takes rank configs: the epilogue
    kernel is the same for every rank, and no cuBLASLt call happens there."""
    from stofc.tune.runner_segments import candidate_segment, compile_segment

    _, _, _, _, spaces = bert
    for space in spaces:
        ranked = [c for c in space.configs() if c.get(LT_ALGO) == 5]
        if not ranked:
            continue
        compile_segment(space.payload, ranked[0].key)
        seg = candidate_segment(space.payload, ranked[0])
        assert seg.kernel.param(LT_ALGO) == 5 and seg.kernel.param(LT_M) == 16 * 2048
