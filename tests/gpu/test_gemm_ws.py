"""The Hopper GEMM with a fused epilogue (``gemm/gemm_ws.cu.j2``) against float64 (sm_90 only).

``out = act(x @ w + bias)`` through :func:`stofc.runtime.gemm_ws.bind_gemm_ws`, for fp16 and
bf16, every activation, with and without a bias, the default config and the ping-pong and
128-wide ones, on shapes with partial tiles in M, N and K (rows, columns and k past a tile's
end), a single tile, and more tiles than SMs (the persistent loop and the ring's wrap):

* every output element written (the output starts as NaN) and nothing past it (a NaN guard
  row after the output stays NaN);
* within the rounding of the output: normwise relative error <= 2 u (u = 2^-11 fp16, 2^-8
  bf16) plus the fp32 accumulation term sqrt(K) 2^-22, against float64 of the rounded inputs;
* the branchless GELU-erf of the epilogue rounds as float64 GELU would: within half an fp16
  ulp plus 4e-6 relative, over 4096 inputs in [-8, 8].
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from stofc.kernels.gemm_ws import DEFAULT, GemmWsConfig, GemmWsProblem


def _hopper() -> bool:
    try:
        from stofc.targets import detect
        return detect().compute_capability == (9, 0)
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _hopper(), reason="the Hopper GEMM needs an sm_90 GPU")

U = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
CONFIGS = {"default": DEFAULT, "pingpong": GemmWsConfig(bn=256, stages=4, coop=False, pass_cols=128),
           "n128": GemmWsConfig(bn=128, stages=5, coop=True, pass_cols=128)}
SHAPES = [(64, 64, 256), (1000, 200, 200), (130, 72, 136), (4096, 768, 3072), (8320, 96, 520)]


def _act64(y: np.ndarray, act: str) -> np.ndarray:
    if act == "gelu_erf":
        erf = np.vectorize(math.erf)
        return 0.5 * y * (1.0 + erf(y / math.sqrt(2.0)))
    if act == "gelu_tanh":
        return 0.5 * y * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y**3)))
    if act == "relu":
        return np.maximum(y, 0.0)
    if act == "silu":
        return y / (1.0 + np.exp(-y))
    return y


def _run(dtype: str, act: str, bias: bool, shape, config: GemmWsConfig):
    import cupy as cp

    from stofc.runtime.gemm_ws import bind_gemm_ws, load_gemm_ws

    m, k, n = shape
    rng = np.random.default_rng(m * 7 + k * 3 + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32) / math.sqrt(k)
    b = rng.standard_normal(n, dtype=np.float32)
    cdt = cp.float16 if dtype == "float16" else None
    if dtype == "float16":
        xs, ws, bs = (cp.asarray(a).astype(cdt) for a in (x, w, b))
        to64 = lambda a: cp.asnumpy(a).astype(np.float64)  # noqa: E731
    else:
        from stofc.kernels.attention.reference import from_bf16_bits, to_bf16_bits
        xs, ws, bs = (cp.asarray(to_bf16_bits(a)) for a in (x, w, b))
        to64 = lambda a: from_bf16_bits(cp.asnumpy(a)).astype(np.float64)  # noqa: E731
    problem = GemmWsProblem(dtype, act, bias)
    kernel = load_gemm_ws(problem, config)
    nan = np.uint16(0x7E00 if dtype == "float16" else 0x7FC0)
    buf = cp.full((m + 1, n), nan, dtype=cp.uint16)
    out = buf[:m].view(cdt) if dtype == "float16" else buf[:m]
    from stofc.targets import detect
    bind_gemm_ws(kernel, problem, xs, ws, bs, out, sms=detect().sm_count, config=config).launch()
    cp.cuda.runtime.deviceSynchronize()
    ref = to64(xs) @ to64(ws) + (to64(bs) if bias else 0.0)
    got = to64(out)
    guard = cp.asnumpy(buf[m])
    return _act64(ref, act), got, guard, nan


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gelu_erf_with_bias(dtype, shape, config):
    want, got, guard, nan = _run(dtype, "gelu_erf", True, shape, CONFIGS[config])
    assert np.isfinite(got).all(), "unwritten (NaN) or non-finite outputs"
    assert (guard == nan).all(), "a store landed past the output"
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    bound = 2 * U[dtype] + math.sqrt(shape[1]) * 2.0**-22
    assert err <= bound, f"relative error {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("act", ["none", "gelu_tanh", "relu", "silu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_activation(dtype, bias, act):
    shape = (1000, 200, 200)
    want, got, guard, nan = _run(dtype, act, bias, shape, DEFAULT)
    assert np.isfinite(got).all() and (guard == nan).all()
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    bound = 2 * U[dtype] + math.sqrt(shape[1]) * 2.0**-22
    assert err <= bound, f"relative error {err:.3e} > {bound:.3e}"


def test_gelu_erf_rounds_as_the_exact_value():
    """out[i, :] = GELU(v_i) for 4096 fp16 values v_i in [-8, 8] (x's first column, w's first
    row all ones: the products are exact): each output within half an fp16 ulp of float64
    GELU(v_i), plus the fast form's 4e-6 relative (a tie may round the other way)."""
    import cupy as cp

    from stofc.runtime.gemm_ws import bind_gemm_ws, load_gemm_ws
    from stofc.targets import detect

    m, k, n = 4096, 64, 64
    v = np.linspace(-8.0, 8.0, m).astype(np.float16)
    x = np.zeros((m, k), np.float16)
    x[:, 0] = v
    w = np.zeros((k, n), np.float16)
    w[0, :] = 1.0
    problem = GemmWsProblem("float16", "gelu_erf", False)
    kernel = load_gemm_ws(problem, DEFAULT)
    out = cp.full((m, n), np.nan, cp.float16)
    bind_gemm_ws(kernel, problem, cp.asarray(x), cp.asarray(w), cp.zeros(n, cp.float16), out,
                 sms=detect().sm_count).launch()
    got = cp.asnumpy(out).astype(np.float64)
    want = _act64(v.astype(np.float64), "gelu_erf")
    assert (got == got[:, :1]).all(), "the columns differ"
    ulp = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
    err = np.abs(got[:, 0] - want)
    assert (err <= 0.5 * ulp + 4e-6 * np.abs(want)).all(), float((err / ulp).max())
