"""How long a split launch's kernels run on the GPU (CUPTI through torch.profiler, 20
back-to-back launches, warm L2) against ``do_bench`` of the pair and of the combine launched
alone, as ``ws_variants.py``'s ``combine_us`` column times it (cold L2, and the host's launch
gap inside the events). A PDL-launched combine starts before the main kernel ends, so its
CUPTI duration includes its wait beside the main kernel's tail.

Usage (GPU machine): PYTHONPATH=. python3 bench/combine_cupti.py  (one JSON line a case)
"""

from __future__ import annotations

import json

import cupy as cp
import torch
from attention_timing import cupy_view
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from stofc.kernels.attention import select_kernel
from stofc.masks import encode
from stofc.runtime.attention import AttentionOp
from stofc.targets import detect

CASES = [("1:12:4096:64:fp16", "dense"), ("1:32:4096:128:bf16", "dense"),
         ("1:12:8192:64:fp16", "longformer:window=256,global=16")]


def measure(case: str, spec: str, profile_: object, stream: cp.cuda.Stream) -> dict:
    """The selector's pick for ``case`` (``B:H:L:D:dtype``) and mask ``spec``: do_bench of
    its launch and of its combine alone, and each kernel's mean CUPTI duration."""
    B, H, L, D = (int(x) for x in case.split(":")[:4])
    tdt = torch.bfloat16 if case.endswith("bf16") else torch.float16
    q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=tdt) for _ in range(3))
    out = torch.empty_like(q)
    fmt = encode(spec, L)
    cfg = select_kernel(fmt, profile_, batch=B, heads=H, seq_len=L, head_dim=D).config
    op = AttentionOp(fmt, cfg, "bfloat16" if tdt == torch.bfloat16 else "float16", D, profile_)
    bound = op.bind(cupy_view(q), cupy_view(k), cupy_view(v), cupy_view(out), layout="bshd")
    bound.launch(stream)
    torch.cuda.synchronize()
    whole = do_bench(lambda: bound.launch(stream), warmup=25, rep=100, return_mode="median")
    then = bound.then
    comb = (do_bench(lambda: then.launch(stream), warmup=25, rep=100, return_mode="median")
            if then is not None else None)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            bound.launch(stream)
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.name.startswith("stofc"):
            times.setdefault(e.name, []).append(getattr(e, "device_time_total", None)
                                                or e.cuda_time_total)
    return {"case": case, "mask": spec, "config": cfg.describe(),
            "do_bench_launch_us": round(whole * 1e3, 1),
            "do_bench_combine_alone_us": round(comb * 1e3, 1) if comb else None,
            "cupti_us": {n: round(sum(t) / len(t), 1) for n, t in times.items()}}


def main() -> int:
    profile_ = detect()
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    for case, spec in CASES:
        print(json.dumps(measure(case, spec, profile_, stream)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
