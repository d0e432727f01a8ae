"""What Longformer's global query rows cost inside the ws launch, and what they would cost
as a separate small-query attention (a development probe for the next lever).

For each case ``B:H:L:D:dtype`` it times, on one stream with CUDA events
(``ws_trace.time_us``, 100 runs, two rounds): the selector's ws launch (main kernel, then
the combine of split rows) for ``longformer:window=256,global=16`` and for its band alone
(``sliding:window=256``), so the difference is what the 16 global queries and the 16 global
keys add; and torch's SDPA on the 16 global queries against all L keys (flash, efficient
and cuDNN backends where they run), which is the work those rows would be as a kernel of
their own. Each stofc output is checked against SDPA in float32 on the same inputs
(relative error over the whole output).
Usage: PYTHONPATH=.:bench python3 bench/global_rows_probe.py [B:H:L:D:dtype ...]
"""

from __future__ import annotations

import json
import sys

import cupy as cp
import torch
import torch.nn.functional as F
from attention_timing import cupy_view
from torch.nn.attention import SDPBackend, sdpa_kernel
from ws_trace import time_us

from stofc.kernels.attention.ws_cost import ws_config
from stofc.masks import encode, to_dense
from stofc.runtime.attention import AttentionOp
from stofc.targets import detect

LONGFORMER, BAND, GLOBAL = "longformer:window=256,global=16", "sliding:window=256", 16
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def random_qkv(case: str) -> tuple[int, int, int, int, str, tuple[torch.Tensor, ...]]:
    """``(B, H, L, D, dtype, (q, k, v))`` of a case ``B:H:L:D:dtype``: [B, L, H, D] normal
    inputs on the GPU, seeded alike for every case."""
    B, H, L, D = (int(x) for x in case.split(":")[:4])
    dtype = case.split(":")[4]
    tdt = torch.float16 if dtype == "float16" else torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    return B, H, L, D, dtype, tuple(torch.randn((B, L, H, D), device="cuda", dtype=tdt,
                                                generator=gen) for _ in range(3))


def _stofc(spec: str, q, k, v, B: int, H: int, L: int, D: int, dtype: str, profile, stream):
    """(config, us of two rounds, relative error against float32 SDPA with the mask)."""
    fmt = encode(spec, L)
    cfg = ws_config(fmt, profile, batch=B, heads=H, head_dim=D)
    assert cfg is not None, spec
    out = torch.full_like(q, float("nan"))
    bound = AttentionOp(fmt, cfg, dtype, D, profile).bind(*(cupy_view(x) for x in (q, k, v, out)),
                                                          layout="bshd")
    us = [round(time_us(lambda: bound.launch(stream), stream, reps=100), 2) for _ in range(2)]
    allowed = torch.from_numpy(to_dense(fmt)).cuda()
    ref = F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)),
                                         attn_mask=allowed).transpose(1, 2)
    err = float((out.float() - ref).norm() / ref.norm())
    return cfg.describe(), us, err


def main() -> int:
    cases = sys.argv[1:] or ["1:12:8192:64:float16", "1:12:16384:64:float16",
                             "1:16:16384:128:bfloat16"]
    profile = detect()
    stream = cp.cuda.Stream(non_blocking=True)
    torch_stream = torch.cuda.ExternalStream(stream.ptr)
    for case in cases:
        B, H, L, D, dtype, (q, k, v) = random_qkv(case)
        row: dict = {"case": case, "gpu": torch.cuda.get_device_name()}
        with torch.cuda.stream(torch_stream):
            for name, spec in (("longformer", LONGFORMER), ("band", BAND)):
                cfg, us, err = _stofc(spec, q, k, v, B, H, L, D, dtype, profile, stream)
                row[name] = {"config": cfg, "us": us, "relerr": round(err, 6)}
            qg = q[:, :GLOBAL].transpose(1, 2)             # the global queries, all keys
            kt, vt = k.transpose(1, 2), v.transpose(1, 2)
            ref = F.scaled_dot_product_attention(qg.float(), kt.float(), vt.float())
            for name, backend in BACKENDS.items():
                try:
                    with sdpa_kernel(backend):
                        def fn(qg=qg, kt=kt, vt=vt):
                            return F.scaled_dot_product_attention(qg, kt, vt)

                        got = fn()
                        us = [round(time_us(fn, stream, reps=100), 2) for _ in range(2)]
                    err = float((got.float() - ref).norm() / ref.norm())
                    row[f"sdpa_{name}"] = {"us": us, "relerr": round(err, 6)}
                except RuntimeError as e:              # a backend that refuses the shape
                    row[f"sdpa_{name}"] = repr(e)[:120]
        lf, band = min(row["longformer"]["us"]), min(row["band"]["us"])
        row["global_rows_in_launch_us"] = round(lf - band, 2)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
