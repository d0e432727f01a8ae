"""GatedGemm's CUDA twin in ONNX Runtime's CUDA EP, and the issue-15 fixtures' packages there.

Skipped unless a CUDA device and onnxruntime's CUDAExecutionProvider both exist. Single-op
models check the twin (cuBLASLt with its BIAS epilogue, then the gated-activation kernel)
against the CPU twin for every activation, with and without a bias, at several M (one
cuBLASLt plan each); bfloat16 against numpy through Casts. Package tests compile the
Llama, Phi-3, Gemma 2 and ModernBERT fixtures (gated FFNs; Phi-3's and ModernBERT's packed
Q|K|V behind RoPE) with their own masks for this GPU, in float16 and bfloat16, and check
``stofc verify`` on the CUDA EP against the original and that every GatedGemm ran there.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

ort = pytest.importorskip("onnxruntime")
if "CUDAExecutionProvider" not in ort.get_available_providers():
    pytest.skip("onnxruntime has no CUDAExecutionProvider", allow_module_level=True)

from stofc.kernels.reference import gated  # noqa: E402
from stofc.kernels.render import render_kernel  # noqa: E402
from stofc.lower.twins import gated_epilogue_kernel, gated_launch_attributes  # noqa: E402
from tests.gpu.test_ort_cuda import (  # noqa: E402
    CPU,
    CUDA,
    arch,  # noqa: F401
    lib,  # noqa: F401
    make_model,
    sessions,
    write_kernel,
)

ROOT = Path(__file__).resolve().parents[2]
K, F = 256, 352
F16, BF16, F32 = TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT


def _attrs(tmp_path, arch, act, dtype):  # noqa: F811
    kern = gated_epilogue_kernel(act, F, dtype)
    src = render_kernel(kern, (arch,)).source
    return gated_launch_attributes(kern, write_kernel(tmp_path, src, arch))


@pytest.mark.parametrize("act,has_bias", list(itertools.product(
    ("silu", "gelu_erf", "gelu_tanh", "relu"), (False, True))))
def test_gated_gemm_cuda_matches_cpu_twin(tmp_path, lib, arch, act, has_bias):  # noqa: F811
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array((rng.standard_normal((K, 2 * F)) * K ** -0.5
                                      ).astype(np.float16), "w")]
    if has_bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(2 * F).astype(np.float16), "b"))
    node = helper.make_node("GatedGemm", ["x", "w", "b" if has_bias else ""], ["y"],
                            domain="ai.stofc", activation=act,
                            **_attrs(tmp_path, arch, act, "float16"))
    model = make_model(node, [helper.make_tensor_value_info("x", F16, ["B", "S", K])],
                       [helper.make_tensor_value_info("y", F16, ["B", "S", F])], inits)
    cuda, cpu = sessions(model, tmp_path, lib)
    for B, S in ((1, 1), (2, 77), (4, 256), (2, 77)):
        feeds = {"x": rng.standard_normal((B, S, K)).astype(np.float16)}
        got = cuda.run(None, feeds)[0].astype(np.float32)
        want = cpu.run(None, feeds)[0].astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2, err_msg=f"B={B} S={S}")


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_gemm_cuda_bfloat16_matches_numpy(tmp_path, lib, arch, act):  # noqa: F811
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((K, 2 * F)) * K ** -0.5).astype(np.float32)
    b = rng.standard_normal(2 * F).astype(np.float32)
    nodes = [helper.make_node("Cast", [n], [f"{n}_b"], to=BF16) for n in ("x", "w", "b")]
    nodes += [helper.make_node("GatedGemm", ["x_b", "w_b", "b_b"], ["y_b"], domain="ai.stofc",
                               activation=act, **_attrs(tmp_path, arch, act, "bfloat16")),
              helper.make_node("Cast", ["y_b"], ["y"], to=F32)]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "t", [vi("x", F32, ["M", K])], [vi("y", F32, ["M", F])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.stofc", 1)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.add_session_config_entry("stofc.package_dir", str(tmp_path))
    so.register_custom_ops_library(str(lib))
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=[CUDA, CPU])

    def bf(a):
        a = np.asarray(a, np.float32).view(np.uint32)
        return ((a + 0x7FFF + ((a >> 16) & 1)) & 0xFFFF0000).view(np.float32)

    x = rng.standard_normal((133, K)).astype(np.float32)
    (y,) = sess.run(None, {"x": x})
    t = bf(bf(x).astype(np.float64) @ bf(w) + bf(b))     # cuBLASLt writes t in bfloat16
    want = gated(t, act)
    err = np.linalg.norm(y - want) / np.linalg.norm(want)
    assert err <= 2 * 2 * 2.0 ** -8, err                 # two roundings (t, y), u = 2^-8


FIXTURES = ["llama_dynamo_op18", "phi3_ts_op17", "gemma2_ts_op17_eager", "modernbert_ts_op17"]
# bf16 Gemma 2: compile's own CPU-EP check measures 1.33e-2 > 1e-2 since its FFN runs in
# bf16 (it ran float32 in ONNX Runtime before; the GatedGemm itself is one rounding from
# float32 ops, and keeping its output float32 would only reach 1.29e-2): compile refuses it
BF16_OVER_BOUND = {"gemma2_ts_op17_eager"}
CASES = [(f, d) for f in FIXTURES for d in ("fp16", "bf16")]


@pytest.mark.parametrize("fixture,dtype", [
    pytest.param(f, d, marks=pytest.mark.xfail(strict=True, reason="bf16 Gemma 2 over the bound"))
    if d == "bf16" and f in BF16_OVER_BOUND else (f, d) for f, d in CASES])
def test_gated_fixture_package_on_cuda_matches_the_original(tmp_path, fixture, dtype):
    from stofc.package.load import load, read_plan_document
    from stofc.package.verify import make_inputs, verify_package
    from stofc.pipeline import Instruments, compile_model
    from stofc.targets import detect
    from tests.gpu.test_ort_cuda import stofc_providers

    model = ROOT / "tests" / "fixtures" / f"{fixture}.onnx"
    pkg = compile_model(model, "model", gpu=detect().name, dtype=dtype, max_seq_len=64,
                        out_dir=tmp_path / "pkg", instruments=Instruments(progress=False))
    plan = read_plan_document(pkg).plan
    assert all(any(s.family == "gemm_glu" for s in lp.segments) for lp in plan.layers)
    report = verify_package(pkg, model=model, provider="cuda", cases=[(2, 64), (1, 17)])
    assert report.passed, report.to_dict()

    def profiled(so):
        so.enable_profiling = True
        so.profile_file_prefix = str(tmp_path / "prof")

    from stofc.frontend import load_model

    cuda = load(pkg, providers=[CUDA, CPU], session_options_hook=profiled)
    feeds, _ = make_inputs(load_model(model), 2, 64, np.random.default_rng(0))
    names = [o.name for o in cuda.get_outputs()]
    placed = stofc_providers(cuda, lambda: cuda.run(names, feeds))
    assert placed.get("GatedGemm") == {CUDA} and all(p == {CUDA} for p in placed.values()), \
        placed
