"""The CUDA twins' run path in ONNX Runtime, without a GPU, against a recording fake driver.

A test build of ``libstofc_ort.so`` (``-DSTOFC_CUDA_TWINS_ON_CPU``: the CUDA twins
registered for the CPU EP, scratch from the CPU allocator) runs in ONNX Runtime's
CPU EP against ``cuda/ort/tests/fake_cuda.cc``, loaded as ``libcuda.so.1`` and as
cuBLASLt. The fake executes nothing but the key-prep kernel (on the host) and logs
every driver / cuBLASLt call with the decoded kernel arguments. The tests check:
session-creation errors for bad CUDA attributes, the capture guard, and that each
launch is exactly what ``stofc/runtime/attention.py`` (``AttentionOp.bind``, run on
the CPU with a numpy CuPy) launches, resp. what ``SegmentRunner._run_vendor``
asks of cuBLASLt and the Add+Norm kernel.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from stofc.kernels.attention import KernelSpec, smem_bytes
from stofc.kernels.attention.launch import launch_data
from stofc.kernels.epilogue import Epilogue
from stofc.kernels.vendor_gemm import GemmSplit, split_fused_gemm
from stofc.lower.twins import KERNEL_ABI, epilogue_kernel, launch_attributes, norm_epilogue
from stofc.masks import encode
from stofc.package.maskbin import write_attention_plan, write_mask_binary
from tests.unit.test_ortlib_abi import CASES, abi_table, cpu_runtime  # noqa: F401

F16 = TensorProto.FLOAT16
H, D = 2, 64
RUNNER = r"""
import json, sys
import numpy as np, onnxruntime as ort
spec = json.load(open(sys.argv[1]))
so = ort.SessionOptions()
so.add_session_config_entry("stofc.package_dir", spec["pkg"])
so.register_custom_ops_library(spec["lib"])
try:
    sess = ort.InferenceSession(spec["model"], so, providers=["CPUExecutionProvider"])
    for i, path in enumerate(spec["feeds"]):
        with open(spec["log"], "a") as f:
            f.write(json.dumps({"call": "run", "index": i}) + "\n")
        sess.run(None, dict(np.load(path)))
except Exception as err:
    print("ERROR", str(err).strip().splitlines()[0])
    sys.exit(3)
"""


def run(fake: dict, pkg: Path, model: onnx.ModelProto, feeds: list[dict], **env) -> tuple:
    """Run ``model`` once per feed dict in a subprocess; (returncode, stdout, log records)."""
    onnx.save(model, str(pkg / "model.onnx"))
    paths = []
    for i, f in enumerate(feeds):
        np.savez(pkg / f"feeds{i}.npz", **f)
        paths.append(str(pkg / f"feeds{i}.npz"))
    log = pkg / "calls.jsonl"
    log.unlink(missing_ok=True)
    spec = {"pkg": str(pkg), "lib": str(fake["lib"]), "model": str(pkg / "model.onnx"),
            "feeds": paths, "log": str(log)}
    (pkg / "spec.json").write_text(json.dumps(spec))
    full_env = dict(os.environ, LD_LIBRARY_PATH=str(fake["dir"]), STOFC_CUBLASLT=str(fake["fake"]),
                    STOFC_FAKE_CUDA_LOG=str(log), **env)
    res = subprocess.run([sys.executable, "-c", RUNNER, str(pkg / "spec.json")],
                         capture_output=True, text=True, env=full_env, check=False)
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return res.returncode, res.stdout + res.stderr, records


def make_model(node, inputs, outputs, inits=()):
    graph = helper.make_graph([node], "t", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.stofc", 1)])
    model.ir_version = 8
    return model


# ---------------------------------------------------------------- SparseAttention


def attention_package(pkg: Path, spec: str, L: int, config, *, kpm: bool, bias: bool,
                      **override):
    fmt = encode(spec, L)
    write_mask_binary(fmt, pkg / "mask.bin")
    write_attention_plan(launch_data(fmt, config), pkg / "a.plan.bin")
    kspec = KernelSpec(config, "float16", D, has_bias=bias, has_key_bits=kpm)
    (pkg / "k.cubin").write_bytes(b"not a real cubin: the fake driver only records\0")
    per_row = config.q_split if config.kind == "block" else config.tile // config.rows_per_block
    attrs = dict(num_heads=H, head_dim=D, scale=0.125, mask_file="mask.bin",
                 kernel=f"k.cubin:{kspec.name}", kernel_abi=KERNEL_ABI, launch_plan="a.plan.bin",
                 block_threads=config.threads, blocks_per_tile_row=per_row,
                 smem_bytes=smem_bytes(config, D) if config.kind == "block" else 0)
    attrs.update(override)
    names = ["q", "k", "v", "kpm" if kpm else "", "bias" if bias else ""]
    while names[-1] == "":
        names.pop()
    node = helper.make_node("SparseAttention", names, ["out"], domain="ai.stofc",
                            **{k: v for k, v in attrs.items() if v is not None})
    inputs = [helper.make_tensor_value_info(n, F16, ["B", "S", H * D]) for n in ("q", "k", "v")]
    if kpm:
        inputs.append(helper.make_tensor_value_info("kpm", TensorProto.INT64, ["B", "S"]))
    if bias:
        inputs.append(helper.make_tensor_value_info("bias", F16, [1, H, "S", "S"]))
    out = [helper.make_tensor_value_info("out", F16, ["B", "S", H * D])]
    return fmt, make_model(node, inputs, out)


def feeds_for(rng, B, S, kpm, bias):
    f = {n: rng.standard_normal((B, S, H * D)).astype(np.float16) for n in ("q", "k", "v")}
    if kpm:
        m = np.ones((B, S), np.int64)
        m[-1, S // 2:] = 0
        m[0, 3] = 0
        f["kpm"] = m
    if bias:
        f["bias"] = np.zeros((1, H, S, S), np.float16)
    return f


def device_array(records, ptr: int, dtype, count: int) -> np.ndarray:
    """``count`` elements at fake device address ``ptr``, from the logged uploads."""
    for r in records:
        if r["call"] == "htod" and r["dst"] <= ptr < r["dst"] + r["bytes"]:
            raw = bytes.fromhex(r["data"])[ptr - r["dst"]:]
            return np.frombuffer(raw, dtype=dtype, count=count)
    raise AssertionError(f"no upload covers {ptr}")


@pytest.mark.parametrize("spec,L,config", CASES, ids=[c[2].describe() for c in CASES])
@pytest.mark.parametrize("kpm,bias", [(False, False), (True, True)], ids=["plain", "kpm+bias"])
def test_attention_launch_equals_attention_op(fake, cpu_runtime, tmp_path, spec, L, config,  # noqa: F811
                                              kpm, bias):
    import stofc.runtime.attention as rt
    from stofc.targets import get_profile

    fmt, model = attention_package(tmp_path, spec, L, config, kpm=kpm, bias=bias)
    rng = np.random.default_rng(0)
    shapes = [(2, L - 37), (1, 70)]
    feeds = [feeds_for(rng, B, S, kpm, bias) for B, S in shapes]
    code, out, records = run(fake, tmp_path, model, feeds)
    assert code == 0, out
    runs = [i for i, r in enumerate(records) if r["call"] == "run"] + [len(records)]
    first, second = records[runs[0]:runs[1]], records[runs[1]:runs[2]]
    assert [r["call"] for r in first].count("mem_alloc") == 1          # the plan, once
    assert not [r for r in second if r["call"] in ("mem_alloc", "htod", "module_load")]
    op = rt.AttentionOp(fmt, config, "float16", D, profile=get_profile("h100"))
    op._kernel = lambda has_bias, has_key_bits, has_softcap: (None,)
    names = dict(abi_table())
    for (B, S), f, recs in zip(shapes, feeds, (first, second), strict=True):
        prep, attn = [r for r in recs if r["call"] == "launch"]
        assert prep["fn"] == "stofc_key_prep" and prep["grid"] == [B, 1, 1]
        assert prep["args"]["kpm_type"] == (1 if kpm else 0)
        shaped = {n: f[n].reshape(B, S, H, D) for n in ("q", "k", "v")}
        kw = {"scale": 0.125}
        if kpm:
            kw["key_mask"] = f["kpm"]
        if bias:
            kw["bias"] = f["bias"]
        want = op.bind(shaped["q"], shaped["k"], shaped["v"], **kw)
        w = dict(zip(names, want.args, strict=True))
        a = attn["args"]
        assert attn["grid"] == [want.grid, 1, 1] and attn["block"] == [want.block, 1, 1]
        assert attn["smem"] == (smem_bytes(config, D) if config.kind == "block" else 0)
        for name, kind in names.items():
            if kind != "ptr":
                assert float(a[name]) == pytest.approx(float(w[name]), rel=1e-6), name
        plan_arrays = {"tile_row_ptr": np.int32, "tile_key": np.int32, "tile_part": np.int32,
                       "bitmaps": np.uint64, "gather_keys": np.int32, "q_perm": np.int32,
                       "row_order": np.int32}
        for name, dtype in plan_arrays.items():
            expect = np.asarray(w[name]).ravel()
            got = device_array(records, a[name], dtype, expect.size)
            assert np.array_equal(got, expect), name
        assert a["kv_len_values"] == np.asarray(w["kv_len"]).tolist()
        if kpm:
            assert [int(x) for x in a["key_bits_values"]] == \
                np.asarray(w["key_bits"]).ravel().tolist()
        assert len({a["q"], a["k"], a["v"], a["o"]}) == 4
        assert (a["bias"] != a["q"]) == bias


BAD = [
    ({"kernel_abi": None}, "carries no CUDA launch attributes (kernel_abi 4)"),
    ({"kernel_abi": 1}, "kernel_abi=1 but this library launches kernel_abi 4"),
    ({"launch_plan": None}, "attribute 'launch_plan'"),
    ({"launch_plan": "nope.plan.bin"}, "cannot be opened"),
    ({"kernel": "missing.cubin:stofc_attn_block_f16_d64_t64_w4_m16_s2_q1_o1_b0_k0"},
     "kernel file"),
    ({"block_threads": 48}, "not a whole number of warps"),
    ({"blocks_per_tile_row": 3}, "splits a tile row in 1 or 2"),
]


@pytest.mark.parametrize("override,message", BAD, ids=[m[:28] for _, m in BAD])
def test_bad_cuda_attributes_fail_at_session_creation(fake, tmp_path, override, message):
    spec, L, config = CASES[0]
    _, model = attention_package(tmp_path, spec, L, config, kpm=False, bias=False, **override)
    code, out, records = run(fake, tmp_path, model, [])
    assert code == 3 and "stofc SparseAttention" in out and message in out, out
    assert not [r for r in records if r["call"] == "run"]            # failed before any run


def test_plan_for_another_mask_fails_at_session_creation(fake, tmp_path):
    spec, L, config = CASES[0]
    _, model = attention_package(tmp_path, spec, L, config, kpm=False, bias=False)
    write_attention_plan(launch_data(encode("causal", L), config), tmp_path / "a.plan.bin")
    code, out, _ = run(fake, tmp_path, model, [])
    assert code == 3 and "was not built for mask file" in out, out


def test_wrong_variant_inputs_fail_the_run(fake, tmp_path):
    spec, L, config = CASES[0]
    _, model = attention_package(tmp_path, spec, L, config, kpm=True, bias=False)
    node = model.graph.node[0]
    node.attribute[[a.name for a in node.attribute].index("kernel")].s = \
        b"k.cubin:stofc_attn_block_f16_d64_t64_w4_m16_s2_q1_o1_b0_k0"   # compiled without key bits
    code, out, _ = run(fake, tmp_path, model, [feeds_for(np.random.default_rng(0), 1, 64, True,
                                                         False)])
    assert code == 3 and "compiled for key_padding_mask absent" in out, out


def test_first_run_under_graph_capture_is_refused(fake, tmp_path):
    spec, L, config = CASES[0]
    _, model = attention_package(tmp_path, spec, L, config, kpm=False, bias=False)
    code, out, records = run(fake, tmp_path, model,
                             [feeds_for(np.random.default_rng(0), 1, 64, False, False)],
                             STOFC_FAKE_CUDA_CAPTURING="1")
    assert code == 3 and "must happen before CUDA graph capture" in out, out
    assert not [r for r in records if r["call"] in ("launch", "htod", "mem_alloc")]


# ---------------------------------------------------------------- FusedGemm, AddLayerNorm

K, N = 64, 128


def test_tanh_gelu_is_cublaslt_s_own_epilogue_and_erf_gelu_never_is():
    # cuBLASLt's GELU epilogue is the tanh formula: it replaces the epilogue kernel for
    # gelu_tanh with nothing after it, and never stands in for the erf GELU
    assert split_fused_gemm(True, "gelu_tanh", False) == GemmSplit(36, False, Epilogue())
    assert split_fused_gemm(False, "gelu_tanh", False) == GemmSplit(32, False, Epilogue())
    assert split_fused_gemm(True, "gelu_erf", False) == \
        GemmSplit(4, False, Epilogue(act="gelu_erf"))
    assert split_fused_gemm(True, "gelu_tanh", True) == \
        GemmSplit(4, False, Epilogue(act="gelu_tanh", residual=True))
    assert split_fused_gemm(True, "gelu_tanh", True, False) == \
        GemmSplit(4, True, Epilogue(act="gelu_tanh"))


@pytest.mark.parametrize("act,has_bias,has_res,after", list(itertools.product(
    ("none", "gelu_erf", "gelu_tanh"), (False, True), (False, True), (1, 0))))
def test_fused_gemm_drives_cublaslt_like_the_vendor_path(fake, tmp_path, act, has_bias, has_res,
                                                         after):
    split = split_fused_gemm(has_bias, act, has_res, bool(after))
    attrs: dict = {"kernel_abi": KERNEL_ABI, "epilogue_kernel": ""}
    if not split.rest.is_identity:
        src = epilogue_kernel(split.rest, N, "float16")
        (tmp_path / "e.cubin").write_bytes(b"fake\0")
        attrs = launch_attributes(src, split.rest, "e.cubin")
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float16), "w")]
    names = ["x", "w", "b" if has_bias else "", "r" if has_res else ""]
    if has_bias:
        inits.append(numpy_helper.from_array(np.ones(N, np.float16), "b"))
    while names[-1] == "":
        names.pop()
    node = helper.make_node("FusedGemm", names, ["y"], domain="ai.stofc", activation=act,
                            residual_after_activation=after, **attrs)
    inputs = [helper.make_tensor_value_info("x", F16, ["M", K])]
    if has_res:
        inputs.append(helper.make_tensor_value_info("r", F16, ["M", N]))
    model = make_model(node, inputs, [helper.make_tensor_value_info("y", F16, ["M", N])], inits)
    feeds = [{"x": np.ones((M, K), np.float16), **({"r": np.ones((M, N), np.float16)}
                                                   if has_res else {})} for M in (33, 33, 7)]
    code, out, records = run(fake, tmp_path, model, feeds)
    assert code == 0, out
    assert [r["call"] for r in records].count("lt_create") == 1
    descs = [r for r in records if r["call"] == "lt_desc"]
    assert len(descs) == 2                                # one plan per M (33, 7), reused
    assert all((d["compute"], d["scale"]) == (68, 0) for d in descs)  # COMPUTE_32F, fp32 scale
    attrs_set = [r for r in records if r["call"] == "lt_desc_attr"]
    by_attr = {r["attr"]: r["data"] for r in attrs_set}
    assert by_attr[3] == by_attr[4] == "00000000"         # A and B untransposed ([K, N] weight)
    assert int.from_bytes(bytes.fromhex(by_attr[7]), "little") == split.lt_epilogue
    assert (8 in by_attr) == has_bias                     # bias pointer only with a bias
    layouts = [(r["type"], r["rows"], r["cols"], r["ld"]) for r in records
               if r["call"] == "lt_layout"]
    assert layouts[:3] == [(2, N, K, N), (2, K, 33, K), (2, N, 33, N)]
    mm = [r for r in records if r["call"] == "lt_matmul"]
    launches = [r for r in records if r["call"] == "launch"]
    assert len(mm) == 3 and all(m["alpha"] == 1.0 for m in mm)
    for m in mm:
        assert m["beta"] == (1.0 if split.lt_residual else 0.0)
        assert (m["C"] != m["D"]) == split.lt_residual and m["ws_size"] == 4096
    if split.rest.is_identity:
        assert not launches
        return
    assert len(launches) == 3
    for m, launch, M in zip(mm, launches, (33, 33, 7), strict=True):
        a = launch["args"]
        assert launch["fn"] == f"stofc_add_norm_float16_{split.rest.tag.replace('-', '_')}" \
            f"_n{N}_t{attrs['epilogue_threads'] // attrs['epilogue_rows']}x{attrs['epilogue_rows']}"
        assert a["x"] == m["D"] and a["out"] != m["D"] and (a["M"], a["N"]) == (M, N)
        assert launch["grid"] == [-(-M // attrs["epilogue_rows"]), 1, 1]
        assert launch["block"] == [attrs["epilogue_threads"], 1, 1]
        assert (a["residual"] != a["x"]) == split.rest.residual


@pytest.mark.parametrize("has_res,rms,has_beta,has_sum", [
    c for c in itertools.product((False, True), repeat=4) if not (c[1] and c[2])])
def test_add_layer_norm_launch(fake, tmp_path, has_res, rms, has_beta, has_sum):
    ep = norm_epilogue(has_residual=has_res, rms=rms, has_beta=has_beta, has_sum=has_sum)
    src = epilogue_kernel(ep, N, "float16")
    (tmp_path / "n.cubin").write_bytes(b"fake\0")
    attrs = launch_attributes(src, ep, "n.cubin")
    inits = [numpy_helper.from_array(np.ones(N, np.float16), "g")]
    names = ["x", "r" if has_res else "", "g"]
    if has_beta:
        inits.append(numpy_helper.from_array(np.zeros(N, np.float16), "be"))
        names.append("be")
    outs = ["y", "s"] if has_sum else ["y"]
    node = helper.make_node("AddLayerNorm", names, outs, domain="ai.stofc", epsilon=1e-5,
                            rms=int(rms), **attrs)
    inputs = [helper.make_tensor_value_info("x", F16, ["M", N])]
    if has_res:
        inputs.append(helper.make_tensor_value_info("r", F16, ["M", N]))
    model = make_model(node, inputs, [helper.make_tensor_value_info(o, F16, ["M", N])
                                      for o in outs], inits)
    feeds = [{"x": np.ones((9, N), np.float16), **({"r": np.ones((9, N), np.float16)}
                                                   if has_res else {})}]
    code, out, records = run(fake, tmp_path, model, feeds)
    assert code == 0, out
    (launch,) = [r for r in records if r["call"] == "launch"]
    a = launch["args"]
    assert launch["fn"] == src.name and (a["M"], a["N"]) == (9, N)
    assert a["eps"] == pytest.approx(1e-5)
    assert launch["grid"] == [-(-9 // src.config.rows), 1, 1] and launch["block"] == [src.config.tpr * src.config.rows,
                                                                                 1, 1]
    assert (a["residual"] != a["x"]) == has_res and (a["beta"] != a["x"]) == has_beta
    assert (a["pre_norm"] != a["out"]) == has_sum and a["gamma"] != a["x"]


def test_norm_kernel_for_another_epilogue_fails_the_run(fake, tmp_path):
    ep = norm_epilogue(has_residual=False, rms=False, has_beta=True, has_sum=False)
    src = epilogue_kernel(ep, N, "float16")
    (tmp_path / "n.cubin").write_bytes(b"fake\0")
    node = helper.make_node("AddLayerNorm", ["x", "r", "g", "be"], ["y"], domain="ai.stofc",
                            **launch_attributes(src, ep, "n.cubin"))
    inits = [numpy_helper.from_array(np.ones(N, np.float16), n) for n in ("g", "be")]
    model = make_model(node, [helper.make_tensor_value_info(n, F16, ["M", N]) for n in "xr"],
                       [helper.make_tensor_value_info("y", F16, ["M", N])], inits)
    code, out, _ = run(fake, tmp_path, model, [{"x": np.ones((2, N), np.float16),
                                                "r": np.ones((2, N), np.float16)}])
    assert code == 3 and "compiled for 'ln' but this node needs 'r-ln'" in out, out


@pytest.mark.parametrize("override,message", [
    ({"launch_plan": "../a.plan.bin"}, "leaves the package directory"),
    ({"launch_plan": "/dev/zero"}, "is an absolute path"),
    ({"kernel": "../k.cubin:stofc_attn_block_f16_d64_t64_w4_m16_s2_q1_o1_b0_k0"},
     "leaves the package directory"),
    ({"kernel": "zero.cubin:stofc_attn_block_f16_d64_t64_w4_m16_s2_q1_o1_b0_k0"},
     "outside the package directory"),
], ids=["plan-dotdot", "plan-absolute", "kernel-dotdot", "kernel-dev-zero-link"])
def test_cuda_file_attributes_are_confined_to_the_package(fake, tmp_path, override, message):
    """issue 16: the CUDA twin's launch_plan and kernel files, like mask_file, must lie in the
    package directory (resolve_package_path), checked at session creation."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "zero.cubin").symlink_to("/dev/zero")
    spec, L, config = CASES[0]
    _, model = attention_package(pkg, spec, L, config, kpm=False, bias=False, **override)
    (tmp_path / "a.plan.bin").write_bytes((pkg / "a.plan.bin").read_bytes())
    (tmp_path / "k.cubin").write_bytes((pkg / "k.cubin").read_bytes())
    code, out, records = run(fake, pkg, model, [])
    assert code == 3 and "stofc SparseAttention" in out and message in out, out
    assert not [r for r in records if r["call"] == "run"]
