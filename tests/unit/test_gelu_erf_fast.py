"""``gelu_erf_fast`` (cuda/stofc/gemm_ws.cuh), the Hopper GEMM's erf-GELU epilogue, checked on
the CPU: the polynomial as written in the header, evaluated with the kernel's float32
roundings (``bench/fit_gelu_erf.py``), against float64 GELU.

* relative error <= 1e-6 on [-3, inf) and <= 1e-5 in the negative tail over [-12, 12], so the
  fp16 and bf16 outputs round as float64 GELU would (the GPU test checks the kernel itself);
* the rounding check of the GPU test, on the CPU: over 4096 inputs in [-8, 8] the fp16 result
  is within half an fp16 ulp plus 4e-6 relative of float64 GELU;
* the header's coefficients are the fit's, rounded to float32 (a re-fit reproduces them).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "cuda" / "stofc" / "gemm_ws.cuh"


@pytest.fixture
def fit(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import fit_gelu_erf
    return fit_gelu_erf


def header_coefficients() -> np.ndarray:
    body = HEADER.read_text().split("float gelu_erf_fast(float x) {", 1)[1].split("\n}", 1)[0]
    first = re.search(r"float q = (-?[0-9.e-]+)f;", body)
    rest = re.findall(r"q = fmaf\(q, t, (-?[0-9.e-]+)f\);", body)
    assert first and len(rest) == 7, body
    return np.array([float(first.group(1))] + [float(c) for c in rest], dtype=np.float32)


def test_float32_error_is_far_below_the_outputs_rounding(fit):
    err = fit.errors(header_coefficients())
    assert err["above_-3"] <= 1e-6, err
    assert err["tail"] <= 1e-5, err


def test_fp16_results_round_as_float64_gelu_would(fit):
    x = np.linspace(-8.0, 8.0, 4096).astype(np.float32)
    exact = fit.gelu64(x)
    got = fit.gelu_f32(x, header_coefficients()).astype(np.float16).astype(np.float64)
    ulp = np.spacing(np.abs(exact).astype(np.float16)).astype(np.float64)
    assert np.all(np.abs(got - exact) <= 0.5 * ulp + 4e-6 * np.abs(exact))


def test_large_inputs_stay_finite_and_exact(fit):
    x = np.array([0.0, 30.0, 3e38, np.inf, -30.0, -3e38], dtype=np.float32)
    got = fit.gelu_f32(x, header_coefficients())
    assert got[0] == 0.0 and got[1] == np.float32(30.0) and got[2] == np.float32(3e38)
    assert got[3] == np.inf and got[4] == 0.0 and got[5] == 0.0


@pytest.mark.slow  # the fit's 400 least-squares rounds
def test_header_coefficients_are_the_fit(fit):
    assert np.array_equal(fit.fit(7).astype(np.float32), header_coefficients())
