"""bfloat16 packages keep LayerNorm's gamma/beta and the pre-LN sum in float32.

The example's bf16 package failed the 1e-2 end-to-end bound on an H200 (rel
1.0858e-2); its CPU twins reproduce that number exactly when the rewrite keeps the
old form (bf16 gamma/beta, FusedGemm writing ``x@W + b + residual`` in bf16).
Checked here: the rewritten bf16 model (float32 gamma/beta; a float32 FusedGemm
result, with a float32 bias and no residual, read only by the AddLayerNorm that
adds the residual), float16 packages unchanged, the CUDA launch attributes (an
Add+Norm kernel for a float x and float gamma/beta; no epilogue kernel and no
tuned cuBLASLt rank on the float GEMM), the mixed-type CPU twins against numpy,
and the bf16 package on ONNX Runtime's CPU EP under the bound on verify's inputs.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from stofc.frontend import load_model
from stofc.kernels.epilogue import Epilogue
from stofc.kernels.norm import NormConfig, NormProblem, kernel_name, render_norm
from stofc.package.load import read_plan, read_plan_document
from stofc.package.ortlib import build_library
from stofc.package.verify import verify_package
from stofc.pipeline import Instruments, compile_model, recompile_package
from stofc.plan.build import plan_layer
from stofc.plan.scheme import FusionScheme
from stofc.targets import get_profile
from tests.unit.test_ortlib_package import check_cuda_attributes
from tests.unit.test_package_qkv import DOMAIN, inits, producer, rewrite, stofc_nodes

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from build_model import build_model  # noqa: E402

BF16, F16, F32 = TensorProto.BFLOAT16, TensorProto.FLOAT16, TensorProto.FLOAT
MASK = "bigbird:block=16,window=3,global=1,random=1,seed=0"   # the failing GPU test's mask


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    return build_library(tmp_path_factory.mktemp("lib"))


@pytest.fixture(scope="module")
def bf16_package(tmp_path_factory) -> tuple[Path, Path]:
    """(package, model) compiled as tests/gpu/test_ort_cuda.py's bf16 case does."""
    root = tmp_path_factory.mktemp("bf16")
    model = root / "model.onnx"
    onnx.save(build_model(seq=512), str(model))
    pkg = compile_model(model, MASK, gpu="h200", dtype="bf16", max_seq_len=256,
                        out_dir=root / "pkg", instruments=Instruments(progress=False))
    return pkg, model


def test_bf16_rewrite_keeps_ln_params_and_pre_ln_sum_fp32(tmp_path):
    _, _, model, emitted = rewrite(build_model(layers=2), tmp_path, dtype="bfloat16")
    init = inits(model)
    norms = stofc_nodes(model, "AddLayerNorm")
    assert len(norms) == 4
    for norm in norms:
        assert [init[n].data_type for n in norm.input[2:]] == [F32, F32]   # gamma, beta
        gemm = producer(model, norm.input[0])
        assert gemm.domain == DOMAIN and gemm.op_type == "FusedGemm"
        assert len(gemm.input) == 3 and init[gemm.input[2]].data_type == F32  # no residual
        assert init[gemm.input[1]].data_type == BF16                         # weights bf16
        assert norm.input[1]                                  # the residual moved to the norm
        readers = [n for n in model.graph.node if norm.input[0] in n.input]
        assert readers == [norm]                              # the float sum feeds only the norm
    # the fp32 bias is the model's own, unrounded
    original = {t.name: t for t in build_model(layers=2).graph.initializer}
    gemm = producer(model, norms[0].input[0])
    name = gemm.input[2].removesuffix("::stofc_f32")
    assert np.array_equal(numpy_helper.to_array(init[gemm.input[2]]),
                          numpy_helper.to_array(original[name]))
    notes = [e.note for e in emitted if "pre-LN sum kept float32" in e.note]
    assert len(notes) == 8                                # 2 segments x 2 norms x 2 layers


def test_fp16_rewrite_is_unchanged_by_the_bf16_path(tmp_path):
    _, _, model, emitted = rewrite(build_model(layers=2), tmp_path, dtype="float16")
    init = inits(model)
    assert all(t.data_type != F32 for n in stofc_nodes(model, "AddLayerNorm")
               for t in (init[i] for i in n.input[2:]))
    for norm in stofc_nodes(model, "AddLayerNorm"):
        gemm = producer(model, norm.input[0])
        assert norm.input[1] == "" and len(gemm.input) == 4   # residual joins the GEMM as before
    assert not [e for e in emitted if "float32" in e.note]
    # the fp16 Add+Norm source renders as before: T gamma/beta, no suffix in the name
    ep = Epilogue(residual=True, norm="layernorm", norm_shift=True)
    src = render_norm(NormProblem(4096, 768, "float16", ep), NormConfig(32, 4))
    assert "const T* __restrict__ gamma, const T* __restrict__ beta" in src.code
    assert src.entry_points == ("stofc_add_norm_float16_r_ln_n768_t32x4",)
    assert "PTYPE" not in dict(src.params)                # plan.json records what it did


def test_norm_kernel_for_float_x_and_params():
    ep = Epilogue(residual=True, norm="layernorm", norm_shift=True)
    problem = NormProblem(4096, 128, "bfloat16", ep, input_fp32=True, params_fp32=True)
    src = render_norm(problem, NormConfig(32, 4))
    assert kernel_name(problem, NormConfig(32, 4)) == "stofc_add_norm_bfloat16_f32in_f32p_r_ln_n128_t32x4"
    assert "typedef float TX;" in src.code
    assert "const float* __restrict__ gamma, const float* __restrict__ beta" in src.code


def test_bf16_package_launch_attributes(bf16_package):
    pkg, _ = bf16_package
    model = onnx.load(str(pkg / "model.onnx"))
    init = inits(model)
    attrs = {n.name: {a.name: helper.get_attribute_value(a) for a in n.attribute}
             for n in model.graph.node}
    for norm in stofc_nodes(model, "AddLayerNorm"):
        entry = attrs[norm.name]["epilogue_kernel"].decode().split(":")[1]
        assert entry.startswith("stofc_add_norm_bfloat16_f32in_f32p_r_ln_"), entry
        assert (pkg / attrs[norm.name]["epilogue_kernel"].decode().split(":")[0]).is_file()
        gemm = producer(model, norm.input[0])
        assert init[gemm.input[2]].data_type == F32
        assert attrs[gemm.name]["epilogue_kernel"] == b""       # cuBLASLt writes the float y
        assert "lt_algo_m" not in attrs[gemm.name]


def test_mixed_type_cpu_twins_equal_numpy(library):
    """FusedGemm (bf16 x, w; float bias) -> float y; AddLayerNorm (float x, bf16 residual,
    float gamma/beta) -> bf16 y: against numpy on the same bf16-representable values."""
    rng = np.random.default_rng(0)
    M, K, N = 6, 32, 16

    def bf(a):  # values exactly representable in bf16 (truncate the low mantissa bits)
        return (np.asarray(a, np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)

    x, w, r = bf(rng.standard_normal((M, K))), bf(rng.standard_normal((K, N))), \
        bf(rng.standard_normal((M, N)))
    b, g, be = (rng.standard_normal(N).astype(np.float32) for _ in range(3))
    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=BF16),
             helper.make_node("Cast", ["wf"], ["wb"], to=BF16),
             helper.make_node("Cast", ["r"], ["rb"], to=BF16),
             helper.make_node("FusedGemm", ["xb", "wb", "b"], ["h"], domain=DOMAIN),
             helper.make_node("AddLayerNorm", ["h", "rb", "g", "be"], ["yb"], domain=DOMAIN,
                              epsilon=1e-5),
             helper.make_node("Cast", ["yb"], ["y"], to=F32)]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "t", [vi("x", F32, [M, K]), vi("r", F32, [M, N])],
                              [vi("h", F32, [M, N]), vi("y", F32, [M, N])],
                              [numpy_helper.from_array(a, n) for a, n in
                               ((w, "wf"), (b, "b"), (g, "g"), (be, "be"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library))
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    h, y = sess.run(None, {"x": x, "r": r})
    want_h = x.astype(np.float64) @ w + b
    assert h.dtype == np.float32 and np.abs(h - want_h).max() < 1e-4      # float, unrounded
    s = h.astype(np.float64) + r
    n = (s - s.mean(-1, keepdims=True)) / np.sqrt(s.var(-1, keepdims=True) + 1e-5) * g + be
    assert np.abs(y - n).max() <= 2.0 ** -8 * np.abs(n).max()             # one bf16 rounding


def test_bf16_package_on_cpu_ep_meets_the_bound(bf16_package):
    """The example bf16 package (the failing GPU test's compile call) on the CPU twins, on
    verify's inputs: the old graph gave 1.0858e-2 here, the H200's exact figure."""
    pkg, model = bf16_package
    report = verify_package(pkg, model=model, provider="cpu")
    assert report.passed, report.to_dict()
    errors = report.to_dict()["errors"]
    assert [(e["batch"], e["seq_len"]) for e in errors] == [(2, 85), (2, 256)]
    assert max(e["rel"] for e in errors) < 1e-2


@pytest.mark.parametrize("segments", [   # as test_ortlib_package's other fusion schemes
    [[0, 1], [2], [3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]],
    [[0, 1], [2], [3, 4], [5, 6], [7], [8, 9], [10, 11, 12], [13]],
], ids=["gemm_norm+gemm_gemm", "add_norm"])
def test_other_fusion_schemes_keep_the_pre_ln_sum_fp32(tmp_path, segments):
    """A gemm_norm segment (GEMM, then the norm adds the residual) and split add_norm
    segments get the same float path; the package runs on the CPU EP within the bound."""
    example = tmp_path / "model.onnx"
    onnx.save(build_model(), str(example))
    quiet = Instruments(progress=False)
    pkg = compile_model(example, "sliding:window=16", dtype="bf16", max_seq_len=64,
                        out_dir=tmp_path / "pkg", instruments=quiet)
    scheme = FusionScheme.from_segments(segments)
    masks = read_plan_document(pkg).masks()
    layers = tuple(plan_layer(layer, scheme, tokens=64, profile=get_profile("h100"),
                              dtype="bfloat16", fmt=masks[layer.index], max_seq_len=64,
                              vendor=False)
                   for layer in load_model(example, pack_projections=True).layers)
    recompile_package(pkg, replace(read_plan(pkg), layers=layers), instruments=quiet)
    assert check_cuda_attributes(pkg)["AddLayerNorm"] == 4
    model = onnx.load(str(pkg / "model.onnx"))
    init = inits(model)
    for norm in stofc_nodes(model, "AddLayerNorm"):
        gemm = producer(model, norm.input[0])
        assert gemm.op_type == "FusedGemm" and init[gemm.input[2]].data_type == F32
        assert [init[n].data_type for n in norm.input[2:]] == [F32, F32] and norm.input[1]
    assert verify_package(pkg).passed
