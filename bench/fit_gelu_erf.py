"""Fit the polynomial of ``gelu_erf_fast`` (cuda/stofc/gemm_ws.cuh) and check it in float32.

The kernel computes the half upper tail of the normal distribution as
``h = t * 2^(Q(t) - log2(e) z^2)``, ``t = 1 / (1 + z / 2)``, ``z = |x| / sqrt 2``, so
``Q(t) = log2(erfc(z) / (2 t)) + log2(e) z^2``, fitted here over z in [0, 10] by iteratively
reweighted least squares towards the minimax polynomial of the given degree. Prints the
coefficients (highest degree first, as float32 literals) and the relative error of the whole
GELU evaluated with float32 roundings (each fmaf rounded once). CPU only:
``python3 bench/fit_gelu_erf.py --degree 7``.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

LOG2E = 1.0 / math.log(2.0)


def fit(degree: int, z_max: float = 10.0, points: int = 40001, rounds: int = 400) -> np.ndarray:
    """Coefficients of Q, highest degree first (float64)."""
    z = np.linspace(0.0, z_max, points)
    erfc = np.array([math.erfc(v) for v in z])
    t = 1.0 / (1.0 + 0.5 * z)
    q = np.log2(0.5 * erfc / t) + LOG2E * z * z
    vander = np.vander(t, degree + 1)
    weight = np.full_like(t, 1.0 / t.size)
    best: tuple[float, np.ndarray] | None = None
    for _ in range(rounds):
        coef, *_ = np.linalg.lstsq(vander * np.sqrt(weight)[:, None], q * np.sqrt(weight),
                                   rcond=None)
        err = np.abs(vander @ coef - q)
        if best is None or err.max() < best[0]:
            best = (float(err.max()), coef.copy())
        weight = weight * np.sqrt(err + 1e-30)
        weight /= weight.sum()
    assert best is not None
    return best[1]


def gelu_f32(x: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """The kernel's operations in float32 (rcp.approx and ex2.approx taken as exact)."""
    f32 = np.float32
    x = np.asarray(x, dtype=f32)
    a = np.abs(x)

    def fma(p, q, r):
        with np.errstate(over="ignore", invalid="ignore"):   # inf, as the kernel's fmaf
            return (p.astype(np.float64) * q + r).astype(f32)

    t = (1.0 / fma(a, f32(0.35355339059327373), f32(1.0)).astype(np.float64)).astype(f32)
    q = np.full_like(t, f32(coef[0]))
    for c in coef[1:]:
        q = fma(q, t, f32(c))
    arg = fma(-a, (a * f32(LOG2E / 2)).astype(f32), q)
    h = (t * np.exp2(arg.astype(np.float64)).astype(f32)).astype(f32)
    with np.errstate(invalid="ignore", over="ignore"):
        return (x * np.where(x >= 0, (f32(1.0) - h).astype(f32), h)).astype(f32)


def gelu64(x: np.ndarray) -> np.ndarray:
    """float64 GELU (erf form, through erfc so the negative tail keeps its digits)."""
    return np.array([0.5 * v * math.erfc(-v / math.sqrt(2.0)) for v in np.asarray(x, float)])


def errors(coef: np.ndarray) -> dict[str, float]:
    """Relative error on [-3, inf) and below -3 (2001 points in [-12, 12])."""
    x = np.linspace(-12.0, 12.0, 2001).astype(np.float32)
    exact = gelu64(x)
    got = gelu_f32(x, coef).astype(np.float64)
    nz = exact != 0
    rel = np.abs(got - exact)[nz] / np.abs(exact[nz])
    return {"above_-3": float(rel[x[nz] >= -3].max()), "tail": float(rel[x[nz] < -3].max())}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--degree", type=int, default=7)
    args = ap.parse_args()
    coef = fit(args.degree).astype(np.float32)
    print("coefficients, highest first:", ", ".join(f"{float(c):.8g}f" for c in coef))
    print(errors(coef))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
