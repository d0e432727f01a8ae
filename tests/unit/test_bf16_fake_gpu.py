"""The CUDA twins' bf16 float pre-LN path in ONNX Runtime, against the recording fake driver.

As tests/unit/test_ortlib_fake_gpu.py (same fixture and runner): a bf16 package's
FusedGemm with a float32 bias must ask cuBLASLt for bf16 A/B with float32 C/D
(CUBLAS_COMPUTE_32F, BIAS epilogue, no C, no epilogue kernel), and its
AddLayerNorm with a float x and float gamma/beta must launch the Add+Norm kernel
compiled for exactly those types (entry ``..._f32in_f32p_...``); a kernel for
other types, or a float-output GEMM given a residual, fails the run with one line.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from stofc.lower.emit import to_tensor
from stofc.lower.twins import KERNEL_ABI, epilogue_kernel, launch_attributes, norm_epilogue
from tests.unit.test_ortlib_fake_gpu import run

BF16, F32 = TensorProto.BFLOAT16, TensorProto.FLOAT
CUDA_R_32F, CUDA_R_16BF = 0, 14
K, N = 64, 128
vi = helper.make_tensor_value_info


def model_of(nodes, inputs, outputs, inits) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "t", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.stofc", 1)])
    model.ir_version = 8
    return model


def gemm_model(residual: bool) -> onnx.ModelProto:
    """x (float, Cast to bf16) @ w (bf16) + b (float32) [+ residual bf16] -> float y."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=BF16)]
    names = ["xb", "w", "b"]
    inputs = [vi("x", F32, ["M", K])]
    if residual:
        nodes.append(helper.make_node("Cast", ["r"], ["rb"], to=BF16))
        names.append("rb")
        inputs.append(vi("r", F32, ["M", N]))
    nodes.append(helper.make_node("FusedGemm", names, ["y"], domain="ai.stofc", activation="none",
                                  kernel_abi=KERNEL_ABI, epilogue_kernel=""))
    inits = [to_tensor(rng.standard_normal((K, N)).astype(np.float32), "bfloat16", "w"),
             numpy_helper.from_array(np.ones(N, np.float32), "b")]
    return model_of(nodes, inputs, [vi("y", F32, ["M", N])], inits)


def test_float_output_gemm_asks_cublaslt_for_fp32_c_and_d(fake, tmp_path):
    feeds = [{"x": np.ones((M, K), np.float32)} for M in (33, 7)]
    code, out, records = run(fake, tmp_path, gemm_model(residual=False), feeds)
    assert code == 0, out
    descs = [r for r in records if r["call"] == "lt_desc"]
    assert len(descs) == 2 and all((d["compute"], d["scale"]) == (68, CUDA_R_32F) for d in descs)
    by_attr = {r["attr"]: r["data"] for r in records if r["call"] == "lt_desc_attr"}
    assert int.from_bytes(bytes.fromhex(by_attr[7]), "little") == 4    # CUBLASLT_EPILOGUE_BIAS
    assert 8 in by_attr                                                # the float bias pointer
    layouts = [(r["type"], r["rows"], r["cols"], r["ld"]) for r in records
               if r["call"] == "lt_layout"]
    assert layouts[:3] == [(CUDA_R_16BF, N, K, N), (CUDA_R_16BF, K, 33, K),
                           (CUDA_R_32F, N, 33, N)]                     # A, B bf16; C = D float
    assert layouts[5] == (CUDA_R_32F, N, 7, N)
    mm = [r for r in records if r["call"] == "lt_matmul"]
    assert len(mm) == 2 and all(m["beta"] == 0.0 and m["C"] == m["D"] for m in mm)  # no residual
    assert not [r for r in records if r["call"] == "launch"]          # cuBLASLt writes y


def test_float_output_gemm_refuses_a_residual(fake, tmp_path):
    feeds = [{"x": np.ones((4, K), np.float32), "r": np.ones((4, N), np.float32)}]
    code, out, _ = run(fake, tmp_path, gemm_model(residual=True), feeds)
    assert code == 3 and "float bias makes y float" in out and "takes no residual" in out, out


def norm_model(src, ep, *, x_float: bool) -> onnx.ModelProto:
    """AddLayerNorm(x float or bf16, residual bf16, gamma/beta float32) -> bf16 y (Cast out)."""
    nodes = [helper.make_node("Cast", ["r"], ["rb"], to=BF16)]
    x = "x"
    if not x_float:
        nodes.append(helper.make_node("Cast", ["x"], ["xb"], to=BF16))
        x = "xb"
    nodes += [helper.make_node("AddLayerNorm", [x, "rb", "g", "be"], ["yb"], domain="ai.stofc",
                               epsilon=1e-5, **launch_attributes(src, ep, "n.cubin")),
              helper.make_node("Cast", ["yb"], ["y"], to=F32)]
    inits = [numpy_helper.from_array(np.ones(N, np.float32), "g"),
             numpy_helper.from_array(np.zeros(N, np.float32), "be")]
    return model_of(nodes, [vi("x", F32, ["M", N]), vi("r", F32, ["M", N])],
                    [vi("y", F32, ["M", N])], inits)


@pytest.mark.parametrize("x_float", [True, False])
def test_add_layer_norm_launches_the_kernel_for_its_types(fake, tmp_path, x_float):
    ep = norm_epilogue(has_residual=True, rms=False, has_beta=True, has_sum=False)
    src = epilogue_kernel(ep, N, "bfloat16", input_fp32=x_float, params_fp32=True)
    (tmp_path / "n.cubin").write_bytes(b"fake\0")
    feeds = [{"x": np.ones((9, N), np.float32), "r": np.ones((9, N), np.float32)}]
    code, out, records = run(fake, tmp_path, norm_model(src, ep, x_float=x_float), feeds)
    assert code == 0, out
    (launch,) = [r for r in records if r["call"] == "launch"]
    prefix = "stofc_add_norm_bfloat16_" + ("f32in_" if x_float else "") + "f32p_r_ln_"
    assert launch["fn"] == src.name and launch["fn"].startswith(prefix)
    a = launch["args"]
    assert (a["M"], a["N"]) == (9, N) and a["residual"] != a["x"] and a["beta"] != a["x"]


@pytest.mark.parametrize("x_float,kernel_x_fp32,kernel_params_fp32,says", [
    (True, False, True, "compiled for x bfloat16 and gamma/beta float but the node gives x float"),
    (False, True, True, "compiled for x float and gamma/beta float but the node gives x bfloat16"),
    (True, True, False, "compiled for x float and gamma/beta bfloat16 but the node gives x float "
                        "and gamma float"),
])
def test_norm_kernel_for_other_types_fails_the_run(fake, tmp_path, x_float, kernel_x_fp32,
                                                   kernel_params_fp32, says):
    ep = norm_epilogue(has_residual=True, rms=False, has_beta=True, has_sum=False)
    src = epilogue_kernel(ep, N, "bfloat16", input_fp32=kernel_x_fp32,
                               params_fp32=kernel_params_fp32)
    (tmp_path / "n.cubin").write_bytes(b"fake\0")
    feeds = [{"x": np.ones((2, N), np.float32), "r": np.ones((2, N), np.float32)}]
    code, out, _ = run(fake, tmp_path, norm_model(src, ep, x_float=x_float), feeds)
    assert code == 3 and says in out, out
