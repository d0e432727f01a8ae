"""FusedGemm's Hopper GEMM in its CUDA twin, without a GPU, against the recording fake driver.

The test build of ``libstofc_ort.so`` (tests/unit/test_ortlib_fake_gpu.py) runs a FusedGemm
node carrying ``hopper_gemm`` / ``hopper_gemm_min_m`` (what :func:`stofc.lower.twins.annotate_cuda`
writes on sm_90 packages, :func:`stofc.kernels.gemm_ws.twin_choice`):

* a run with at least ``hopper_gemm_min_m`` rows makes exactly one launch of the named kernel
  and no cuBLASLt call: grid ``min(tiles, SMs)`` of 384 threads, the config's shared memory
  (:meth:`GemmWsConfig.smem_bytes`), the run's x / w / y / bias pointers, (M, N, K), and the
  x and w tensor maps stofc/runtime/gemm_ws.py encodes (64 x 64 boxes over ``[M, K]`` and
  ``[K, N]``, 128-byte swizzle); the maps are encoded once per buffer;
* a shorter run takes cuBLASLt and the epilogue kernel, as without the attributes; the first
  run loads both kernels' modules whatever its rows (nothing left for a captured run);
* a kernel for the other dtype, or a node with a residual, fails the run in one line; a
  malformed entry name or a missing ``hopper_gemm_min_m`` fails session creation.
The attribute parser itself is checked through the attribute test binary.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from stofc.kernels.epilogue import Epilogue
from stofc.kernels.gemm_ws import (
    DEFAULT,
    THREADS,
    GemmWsConfig,
    GemmWsProblem,
    entry_name,
    gemm_ws_grid,
)
from stofc.lower.twins import epilogue_kernel, launch_attributes
from tests.unit.test_ortlib_cuda import ask
from tests.unit.test_ortlib_fake_gpu import make_model, run

K, N = 64, 520           # N: three 256-wide tiles, the last partial
ELEM = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
MIN_M = 100


def _model(tmp_path, *, dtype="float16", kernel_dtype=None, residual=False, min_m=MIN_M,
           entry=None):
    ep = Epilogue(act="gelu_erf", residual=residual)
    epi = epilogue_kernel(ep, N, dtype)
    (tmp_path / "e.cubin").write_bytes(b"fake\0")
    (tmp_path / "g.cubin").write_bytes(b"fake\0")
    attrs = launch_attributes(epi, ep, "e.cubin")
    name = entry or entry_name(GemmWsProblem(kernel_dtype or dtype, "gelu_erf", True), DEFAULT)
    attrs |= {"hopper_gemm": f"g.cubin:{name}"}
    if min_m is not None:
        attrs["hopper_gemm_min_m"] = min_m
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float16), "w"),
             numpy_helper.from_array(np.ones(N, np.float16), "b")]
    for t in inits:       # same 16-bit payload, read as the dtype
        t.data_type = ELEM[dtype]
    names = ["x", "w", "b"] + (["r"] if residual else [])
    node = helper.make_node("FusedGemm", names, ["yq"], domain="ai.stofc", activation="gelu_erf",
                            **attrs)
    # float inputs and output Cast to and from the dtype (numpy has no bfloat16)
    casts = [helper.make_node("Cast", [f"{v}f"], [v], to=ELEM[dtype]) for v in names
             if v in ("x", "r")]
    inputs = [helper.make_tensor_value_info("xf", TensorProto.FLOAT, ["M", K])]
    if residual:
        inputs.append(helper.make_tensor_value_info("rf", TensorProto.FLOAT, ["M", N]))
    model = make_model(node, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                    ["M", N])], inits)
    model.graph.node.append(helper.make_node("Cast", ["yq"], ["y"], to=TensorProto.FLOAT))
    model.graph.node.insert(0, casts[0])
    for c in casts[1:]:
        model.graph.node.insert(1, c)
    return model


def _feeds(m, dtype="float16", residual=False):
    f = {"xf": np.ones((m, K), np.float32)}
    if residual:
        f["rf"] = np.ones((m, N), np.float32)
    return f


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_long_runs_launch_the_hopper_gemm_and_short_runs_cublaslt(fake, tmp_path, dtype):
    model = _model(tmp_path, dtype=dtype)
    rows = (MIN_M, 300, MIN_M - 1, 300)
    code, out, records = run(fake, tmp_path, model, [_feeds(m, dtype) for m in rows])
    assert code == 0, out
    runs = [i for i, r in enumerate(records) if r["call"] == "run"] + [len(records)]
    maps_made = [r for r in records if r["call"] == "tensor_map"]
    name = entry_name(GemmWsProblem(dtype, "gelu_erf", True), DEFAULT)
    for m, lo, hi in zip(rows, runs, runs[1:], strict=False):
        calls = records[lo + 1:hi]
        launches = [r for r in calls if r["call"] == "launch"]
        mm = [r for r in calls if r["call"] == "lt_matmul"]
        if m < MIN_M:
            assert len(mm) == 1 and len(launches) == 1
            assert launches[0]["fn"].startswith("stofc_add_norm_")
            assert launches[0]["pdl"] is True        # the epilogue waits on the GEMM (pdl.cuh)
            continue
        assert not mm and len(launches) == 1, calls
        launch = launches[0]
        a = launch["args"]
        assert launch["fn"] == name
        assert launch["pdl"] is True                 # programmatic dependent launch (sm_90 PTX)
        assert launch["grid"] == [gemm_ws_grid(m, N, 132), 1, 1]
        assert launch["block"] == [THREADS, 1, 1]
        assert launch["smem"] == DEFAULT.smem_bytes()
        assert (a["M"], a["N"], a["K"]) == (m, N, K)
        assert a["bias"] != a["out"]
        xm, wm = a["x_map"], a["w_map"]
        assert xm["dims"] == [K, m, 1, 1] and xm["strides"] == [2 * K, 2 * K * m, 2 * K * m]
        assert wm["dims"] == [N, K, 1, 1] and wm["strides"] == [2 * N, 2 * N * K, 2 * N * K]
        for mp in (xm, wm):
            assert mp["box"] == [64, 64, 1, 1] and mp["swizzle"] == 3 and mp["rank"] == 4
            assert mp["dtype"] == (9 if dtype == "bfloat16" else 6)
    # x's map per (address, M), w's once: the repeated 300-row run reuses both
    assert len({(r["map"]["address"], tuple(r["map"]["dims"])) for r in maps_made}) == len(maps_made)


def test_the_first_run_loads_both_modules_whatever_its_rows(fake, tmp_path):
    """A short first run (cuBLASLt) loads the Hopper GEMM's module too, so a later long run,
    e.g. one being captured into a CUDA graph, does no first-use work."""
    code, out, records = run(fake, tmp_path, _model(tmp_path), [_feeds(MIN_M - 1), _feeds(300)])
    assert code == 0, out
    second = records.index({"call": "run", "index": 1})
    first, later = records[:second], records[second:]
    assert [r["call"] for r in first].count("module_load") == 2      # epilogue + Hopper GEMM
    assert not [r for r in later if r["call"] == "module_load"]
    assert [r["fn"] for r in later if r["call"] == "launch"] == [
        entry_name(GemmWsProblem("float16", "gelu_erf", True), DEFAULT)]


def test_the_config_in_the_name_sets_grid_and_shared_memory(fake, tmp_path):
    cfg = GemmWsConfig(bn=128, stages=5, coop=True, pass_cols=128)
    model = _model(tmp_path, entry=entry_name(GemmWsProblem("float16", "gelu_erf", True), cfg))
    code, out, records = run(fake, tmp_path, model, [_feeds(1000)])
    assert code == 0, out
    (launch,) = [r for r in records if r["call"] == "launch"]
    assert launch["grid"] == [gemm_ws_grid(1000, N, 132, cfg), 1, 1]
    assert launch["smem"] == cfg.smem_bytes()


@pytest.mark.parametrize("kw,feeds,message", [
    ({"kernel_dtype": "bfloat16"}, {}, "is compiled for bfloat16 with a bias and no residual"),
    ({"residual": True}, {"residual": True}, "with a bias and no residual, which is not this node"),
])
def test_a_kernel_that_does_not_fit_the_node_fails_the_run(fake, tmp_path, kw, feeds, message):
    code, out, _ = run(fake, tmp_path, _model(tmp_path, **kw), [_feeds(500, **feeds)])
    assert code == 3 and message in out, out


@pytest.mark.parametrize("kw,message", [
    ({"min_m": None}, "attribute 'hopper_gemm_min_m'"),
    ({"entry": "stofc_gemm_ws_float16_gelu_erf_b1_n192_s4_coop_p64"}, "not a config the kernel"),
    ({"entry": "stofc_gemm_ws_float16_gelu_erf_b1_n256_s4_coop"}, "not a stofc Hopper GEMM kernel"),
])
def test_bad_hopper_attributes_fail_session_creation(fake, tmp_path, kw, message):
    code, out, records = run(fake, tmp_path, _model(tmp_path, **kw), [_feeds(500)])
    assert code == 3 and message in out, out
    assert not [r for r in records if r["call"] == "run"]


def test_the_attribute_parser_reads_the_entry_name(driver):
    pp = GemmWsConfig(bn=256, stages=4, coop=False, pass_cols=128)
    name = entry_name(GemmWsProblem("bfloat16", "gelu_tanh", False), pp)
    lines = ask(driver,
                ("hopper_gemm", {}),
                ("hopper_gemm", {"hopper_gemm": f"k.cubin:{name}", "hopper_gemm_min_m": 7}),
                ("hopper_gemm", {"hopper_gemm": "k.cubin:" + entry_name(
                    GemmWsProblem("float16", "gelu_erf", True), DEFAULT), "hopper_gemm_min_m": 1024}),
                ("hopper_gemm", {"hopper_gemm": "k.cubin:stofc_gemm_ws_float16_swish_b1_n256_s4_coop_p64",
                                 "hopper_gemm_min_m": 1}),
                ("hopper_gemm", {"hopper_gemm": "k.cubin:" + entry_name(
                    GemmWsProblem("float16"), GemmWsConfig(stages=6)), "hopper_gemm_min_m": 1}))
    assert lines[0] == "OK present=0"
    assert lines[1] == (f"OK present=1 file=k.cubin entry={name} bf16=1 act=gelu_tanh bias=0 bn=256 "
                        f"bm=64 stages=4 pass=128 smem={pp.smem_bytes()} min_m=7")
    assert lines[2].endswith(f"bm=128 stages=4 pass=64 smem={DEFAULT.smem_bytes()} min_m=1024")
    assert lines[3].startswith("ERR ") and "not a stofc Hopper GEMM kernel" in lines[3]
    assert lines[4].startswith("ERR ") and "not a config the kernel takes" in lines[4]
