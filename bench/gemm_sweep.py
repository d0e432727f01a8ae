"""Hand-written GEMM configs vs cuBLAS on the BERT-base layer's GEMM shapes (fp16).

For M in {128, 4096, 32768} and the four GEMMs (QKV 768->2304, out 768->768,
FFN 768->3072, FFN 3072->768), times a handful of valid configs of
``gemm/gemm.cu.j2`` (bias epilogue) and cublasGemmEx, CUDA events, median.
Prints TFLOP/s; the tuner's job in miniature, used to pick the analytical
defaults. Usage: PYTHONPATH=. python3 bench/gemm_sweep.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stofc.kernels import gemm
from stofc.kernels.epilogue import Epilogue
from stofc.targets import get_profile

SHAPES = (("qkv", 2304, 768), ("out", 768, 768), ("ffn_in", 3072, 768), ("ffn_out", 768, 3072))
TOKENS = (128, 4096, 32768)
CONFIGS = (
    gemm.GemmConfig(128, 128, 32, 2, 4, 4), gemm.GemmConfig(128, 128, 64, 2, 4, 3),
    gemm.GemmConfig(128, 256, 32, 2, 4, 3), gemm.GemmConfig(256, 128, 32, 4, 2, 3),
    gemm.GemmConfig(128, 64, 32, 2, 2, 4), gemm.GemmConfig(64, 128, 32, 2, 2, 4),
    gemm.GemmConfig(64, 64, 32, 2, 2, 4), gemm.GemmConfig(32, 64, 32, 1, 2, 4),
    gemm.GemmConfig(64, 64, 64, 2, 2, 3),
)


def valid_configs(problem, profile):
    space = gemm.space(problem, profile)
    out = []
    for c in CONFIGS:
        reason = space.reason({"bm": c.bm, "bn": c.bn, "bk": c.bk, "warps_m": c.warps_m,
                               "warps_n": c.warps_n, "stages": c.stages})
        if reason is None:
            out.append(c)
    return out


def main() -> None:
    import cupy

    from bench.layer import time_fn
    from stofc.runtime.segments import _load, cublas_gemm, to_device

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    profile = get_profile("h100")
    rng = np.random.default_rng(0)
    rows = []
    for m in TOKENS:
        for name, n, k in SHAPES:
            n_rot = int(max(1, min(8, np.ceil(64e6 / (m * (k + n) * 2)))))
            xs = [to_device(rng.standard_normal((m, k)), "float16") for _ in range(n_rot)]
            w = to_device(rng.standard_normal((n, k)) / np.sqrt(k), "float16")
            bias = to_device(rng.standard_normal(n), "float16")
            outs = [cupy.empty((m, n), dtype=cupy.float16) for _ in range(n_rot)]
            flops = 2.0 * m * n * k
            t = time_fn(lambda i, xs=xs, w=w, outs=outs: cublas_gemm(xs[i], w, outs[i],
                                                                      "float16"), n_rot)
            rows.append({"m": m, "gemm": name, "impl": "cublas", "ms": t,
                         "tflops": flops / t / 1e9})
            print(f"M={m:6d} {name:8s} cublas            {t:.4f} ms {flops / t / 1e9:7.1f} TF/s",
                  flush=True)
            problem = gemm.GemmProblem(m, n, k, "float16", Epilogue(bias=True))
            for cfg in valid_configs(problem, profile):
                smem = cfg.smem_bytes("float16")
                _mod, fn = _load(gemm.render_gemm(problem, cfg), "sm_90", smem)
                dummy = cupy.zeros(8, dtype=cupy.float16)

                def call(i, fn=fn, cfg=cfg, smem=smem, xs=xs, w=w, outs=outs, bias=bias,
                         dummy=dummy, n=n, k=k, m=m):
                    fn((-(-n // cfg.bn), -(-m // cfg.bm), 1), (cfg.threads, 1, 1),
                       (xs[i], w, outs[i], bias, dummy, dummy, dummy, dummy, np.int32(m),
                        np.int32(n), np.int32(k), np.int32(m), np.int32(1), np.int32(8),
                        np.float32(0)), shared_mem=smem)
                t = time_fn(call, n_rot)
                tag = f"{cfg.bm}x{cfg.bn}x{cfg.bk} w{cfg.warps_m}x{cfg.warps_n} s{cfg.stages}"
                rows.append({"m": m, "gemm": name, "impl": tag, "ms": t,
                             "tflops": flops / t / 1e9})
                print(f"M={m:6d} {name:8s} {tag:18s}{t:.4f} ms {flops / t / 1e9:7.1f} TF/s",
                      flush=True)
    if args.out:
        Path(args.out, "gemm_sweep.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
