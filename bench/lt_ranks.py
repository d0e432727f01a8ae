"""What each cuBLASLt heuristic rank launches for a FusedGemm's GEMM, and how long it takes.

Why: the BERT package's QKV GEMM (8192 x 2304 x 768 with a bias) is preceded by a
``Memset (Device)`` at every call (CUPTI, e2e-long-h100-2026-11-27-gaps2): cuBLASLt zeroes a
workspace for the algorithm it picked, one more launch and kernel boundary per layer. Per
rank (``stofc.runtime.segment_cublas.CublasLt``, the layout and epilogue the ORT library's
FusedGemm uses): the kernels and memsets one call makes (CUPTI through torch.profiler) and
the median time of 200 calls (CUDA events around each batch of 20).

Usage (GPU machine): ``PYTHONPATH=. python3 bench/lt_ranks.py --shapes 8192:2304:768,8192:768:768``
Prints one JSON line per (shape, rank).
"""

from __future__ import annotations

import argparse
import json


def _measure(lt, code: int, stream, x, w, bias, out, rank: int
             ) -> tuple[float, list[str], float]:
    """(median us of one call at ``rank``, the CUDA activities of one call, the median
    GPU time of one call's activities over 20 profiled calls: the device's cost alone,
    where the timed batches of small shapes measure the host's launch rate)."""
    import cupy as cp
    import numpy as np
    from torch.profiler import ProfilerActivity, profile

    def call():
        lt.matmul(x, w, out, "float16", stream.ptr, bias=bias, epilogue=code, algo_rank=rank,
                  exact_rank=True)

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        stream.synchronize()
    names = [ev.name[:70] for ev in prof.events() if ev.device_type.name == "CUDA"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            call()
        stream.synchronize()
    gpu = [ev.device_time for ev in sorted(prof.events(), key=lambda e: e.time_range.start)
           if ev.device_type.name == "CUDA"]
    per_call = len(gpu) // 20 or 1
    device_us = float(np.median([sum(gpu[i:i + per_call])
                                 for i in range(0, per_call * 20, per_call)]))
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(10):
        start.record(stream)
        for _ in range(20):
            call()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / 20)
    return float(np.median(times)), names, device_us


def main() -> int:
    import cupy as cp
    import numpy as np

    from stofc.runtime import segment_cublas
    from stofc.runtime.segment_cublas import LtRankUnavailable, lt_handle, lt_split

    parser = argparse.ArgumentParser(prog="bench/lt_ranks.py")
    parser.add_argument("--shapes", default="8192:2304:768,8192:768:768,8192:768:3072")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--workspace-mib", type=int, default=None,
                        help="the heuristic's and the matmul's workspace instead of the "
                             "package's (segment_cublas.LT_WORKSPACE, 0: only algorithms that "
                             "need none)")
    args = parser.parse_args()
    if args.workspace_mib is not None:   # a probe of the library's constant, before any handle
        segment_cublas.LT_WORKSPACE = args.workspace_mib * 1024 * 1024
    lt = lt_handle()
    code, _ = lt_split(True, "none", False)
    stream = cp.cuda.get_current_stream()
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split(":"))
        rng = np.random.default_rng(0)
        x = cp.asarray(rng.standard_normal((m, k)).astype(np.float16))
        w = cp.asarray((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16))
        bias = cp.asarray(rng.standard_normal(n).astype(np.float16))
        out = cp.empty((m, n), np.float16)
        want = None
        for rank in range(args.ranks):
            try:
                lt.matmul(x, w, out, "float16", stream.ptr, bias=bias, epilogue=code,
                          algo_rank=rank, exact_rank=True)
            except LtRankUnavailable:
                break
            stream.synchronize()
            got = out.astype(np.float32)
            want = got if want is None else want
            err = float(cp.abs(got - want).max() / cp.abs(want).max())
            us, names, device_us = _measure(lt, code, stream, x, w, bias, out, rank)
            print(json.dumps(dict(m=m, n=n, k=k, rank=rank, us=round(us, 2),
                                  device_us=round(device_us, 2),
                                  workspace=segment_cublas.LT_WORKSPACE,
                                  memsets=sum("Memset" in s for s in names),
                                  kernels=[s for s in names if "Memset" not in s],
                                  rel_vs_rank0=round(err, 5))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
