"""The Hopper GEMM with a fused epilogue (templates/gemm/gemm_ws.cu.j2) against cuBLASLt.

For each shape and variant (BN:STAGES:COOP:PASS, stofc.kernels.gemm_ws.GemmWsConfig): compiles the
template for sm_90a, checks ``act(x @ w + b)`` against float32 (normwise relative error, and
max abs error), then times it against what a package runs today for the same node:
torch's ``addmm`` (cuBLASLt with the bias epilogue) plus the activation as its own pass,
and against the GEMM alone (``addmm``), all with ``triton.testing.do_bench`` in the same
process. Writes one JSON line per (shape, variant) to ``--out``.

    python3 bench/gemm_ws.py --out $OUT/gemm-ws.jsonl
"""

from __future__ import annotations

import argparse
import json
import math

import cupy as cp
import torch
import torch.nn.functional as F
from triton.testing import do_bench

from stofc.kernels.gemm_ws import GemmWsConfig, GemmWsProblem
from stofc.runtime.gemm_ws import bind_gemm_ws, load_gemm_ws


def torch_act(y: torch.Tensor, act: str) -> torch.Tensor:
    if act == "gelu_erf":
        return F.gelu(y)
    if act == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    if act == "relu":
        return F.relu(y)
    if act == "silu":
        return F.silu(y)
    return y


def parse_variant(text: str) -> GemmWsConfig:
    """``BN:STAGES:COOP:PASS``."""
    bn, stages, coop, pass_cols = (int(v) for v in text.split(":"))
    return GemmWsConfig(bn=bn, stages=stages, coop=bool(coop), pass_cols=pass_cols)


def run_shape(dtype: str, shape: str, variants: list[GemmWsConfig], sms: int, gpu: str):
    """One JSON row per variant for ``M:K:N:ACT``."""
    tdt = torch.float16 if dtype == "float16" else torch.bfloat16
    ms, ks, ns, act = shape.split(":")
    M, K, N = int(ms), int(ks), int(ns)
    g = torch.Generator(device="cuda").manual_seed(M * 31 + N)
    x = torch.randn(M, K, device="cuda", generator=g).to(tdt)
    w = (torch.randn(K, N, device="cuda", generator=g) / math.sqrt(K)).to(tdt)
    b = torch.randn(N, device="cuda", generator=g).to(tdt)
    ref = torch_act(x.float() @ w.float() + b.float(), act)
    # what a package runs today: cuBLASLt GEMM + bias, then the activation pass
    base_ms = do_bench(lambda: torch_act(torch.addmm(b, x, w), act))
    gemm_ms = do_bench(lambda: torch.addmm(b, x, w))
    base = torch_act(torch.addmm(b, x, w), act).float()
    base_err = float((base - ref).norm() / ref.norm())
    for cfg in variants:
        row = dict(gpu=gpu, dtype=dtype, M=M, K=K, N=N, act=act, BN=cfg.bn, STAGES=cfg.stages,
                   COOP=int(cfg.coop), PASS=cfg.pass_cols, base_ms=base_ms, gemm_ms=gemm_ms,
                   base_err=base_err)
        try:
            problem = GemmWsProblem(dtype, act, True)
            kernel = load_gemm_ws(problem, cfg)
            # NaN everywhere, with a guard row past the output: every element written, no
            # store past the end
            buf = torch.full((M + 1, N), float("nan"), device="cuda", dtype=tdt)
            y = buf[:M]
            launch = bind_gemm_ws(kernel, problem, cp.asarray(x), cp.asarray(w), cp.asarray(b),
                                  cp.asarray(y), sms=sms, config=cfg)
            launch.launch()
            torch.cuda.synchronize()
            yf = y.float()
            row["finite"] = bool(torch.isfinite(yf).all())
            row["guard_untouched"] = bool(torch.isnan(buf[M]).all())
            row["err"] = float((yf - ref).norm() / ref.norm())
            row["max_abs"] = float((yf - ref).abs().max())
            row["ms"] = do_bench(launch.launch)
            row["tflops"] = 2.0 * M * N * K / row["ms"] * 1e-9
            row["vs_base"] = base_ms / row["ms"]
            row["vs_gemm"] = gemm_ms / row["ms"]
        except Exception as err:  # recorded: a variant may not compile or fit
            row["error"] = f"{type(err).__name__}: {err}"[:400]
        yield row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="256:4:1:64,256:3:1:128,128:5:1:128,256:4:0:128")
    ap.add_argument("--shapes", default="8192:768:3072:gelu_erf,8192:768:3072:none,"
                                        "8192:768:2304:none,8192:3072:768:none,"
                                        "16384:768:3072:gelu_erf,1000:200:200:gelu_erf,"
                                        "4096:1024:4096:gelu_erf,130:72:136:silu")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gpu = torch.cuda.get_device_name(0)
    variants = [parse_variant(v) for v in args.variants.split(",")]
    with open(args.out, "a") as out:
        for dtype in args.dtypes.split(","):
            for shape in args.shapes.split(","):
                for row in run_shape(dtype, shape, variants, sms, gpu):
                    print(json.dumps(row), flush=True)
                    out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
