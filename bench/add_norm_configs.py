"""Add + LayerNorm configs (``norm/add_norm.cu.j2``) against each other on the GPU.

``out = LayerNorm(x + residual)`` in fp16 (a post-norm transformer's Add+Norm after a GEMM
whose bias the GEMM folded), for every config of :func:`stofc.kernels.norm.space` (threads
per row, rows per block), the default, and three-warp rows where a row is 96 vectors wide (outside
the space: not a power of two), checked against float64, timed with CUDA events
in two cache states:

* ``hot``: x was just written (a copy, as the GEMM before it writes it) and the residual is
  cold (256 MiB written in between), the state a package meets;
* ``cold``: both read from DRAM.

One JSON row per (shape, config) on stdout and appended to ``--out``. Run on a GPU machine:
``PYTHONPATH=. python3 bench/add_norm_configs.py --out bench/results/X.jsonl``.
"""

from __future__ import annotations

import argparse
import json

import cupy as cp
import numpy as np

from stofc.compile.nvrtc import compile_source
from stofc.kernels.epilogue import Epilogue
from stofc.kernels.norm import NormConfig, NormProblem, default_config, render_norm, space
from stofc.runtime.module import load_kernel

EP = Epilogue(residual=True, norm="layernorm")


def _configs(problem: NormProblem) -> list[NormConfig]:
    out = [default_config(problem)]
    extra = [NormConfig(96, r) for r in (1, 2, 4)] if problem.n % (96 * 8) == 0 else []
    for cfg in [NormConfig(e["tpr"], e["rows"]) for e in space(problem).configs()] + extra:
        if cfg not in out:
            out.append(cfg)
    return out


def _time(launch, prep, reps: int) -> float:
    """Median ms of ``launch`` after ``prep`` each time (prep not timed)."""
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        prep()
        start.record()
        launch()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def run(m: int, n: int, reps: int, gpu: str):
    problem = NormProblem(m, n, "float16", EP)
    rng = np.random.default_rng(m + n)
    x0 = cp.asarray(rng.standard_normal((m, n)).astype(np.float16))
    res = cp.asarray(rng.standard_normal((m, n)).astype(np.float16))
    gamma = cp.asarray((1 + 0.1 * rng.standard_normal(n)).astype(np.float16))
    beta = cp.asarray((0.1 * rng.standard_normal(n)).astype(np.float16))
    x = cp.empty_like(x0)
    out = cp.empty_like(x0)
    flush = cp.empty(256 << 20, dtype=cp.uint8)
    h = x0.get().astype(np.float64) + res.get().astype(np.float64)
    mu = h.mean(1, keepdims=True)
    ref = (h - mu) / np.sqrt(((h - mu) ** 2).mean(1, keepdims=True) + 1e-5)
    ref = ref * gamma.get().astype(np.float64) + beta.get().astype(np.float64)
    null = cp.zeros(1, dtype=cp.float16)

    def hot():
        flush.fill(1)
        cp.copyto(x, x0)

    def cold():
        cp.copyto(x, x0)
        flush.fill(1)

    for cfg in _configs(problem):
        src = render_norm(problem, cfg)
        kern = load_kernel(compile_source(src, "sm_90"), src.name)
        grid = -(-m // cfg.rows)

        def launch(kern=kern, cfg=cfg, grid=grid):
            kern.launch(grid, cfg.tpr * cfg.rows,
                        (x, null, res, gamma, beta, out, null, np.int32(m), np.int32(n),
                         np.float32(1e-5)))

        cp.copyto(x, x0)
        out.fill(np.nan)
        launch()
        cp.cuda.Device().synchronize()
        got = out.get().astype(np.float64)
        err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        row = dict(gpu=gpu, M=m, N=n, tpr=cfg.tpr, rows=cfg.rows, items=cfg.items(n),
                   default=cfg == default_config(problem), err=err,
                   hot_us=1e3 * _time(launch, hot, reps), cold_us=1e3 * _time(launch, cold, reps))
        row["hot_gbs"] = 3 * m * n * 2 / row["hot_us"] * 1e-3
        yield row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="8192:768,16384:768,1024:768,8192:1024,4096:4096")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    with open(args.out, "a") as fh:
        for shape in args.shapes.split(","):
            m, n = (int(v) for v in shape.split(":"))
            for row in run(m, n, args.reps, gpu):
                print(json.dumps(row), flush=True)
                fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
