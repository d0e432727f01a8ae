"""The selector's ws launch per consumer count, and each launch of its chain alone.

For each case ``spec@B:H:L:D:dtype`` (default: masks with global rows, where the consumer
count is decided by their shared chunks) it times, with CUDA events (``ws_trace.time_us``,
100 runs): the selector's pick restricted to two, three and four consumer warpgroups (two
rounds of the whole chain: main kernel, then the combine and any launch after it), and
each launch of that chain alone (``parts_us``: a launch timed alone also pays its own
launch latency, ~3-4 us more than it adds inside the chain). Every output is checked
against float32 SDPA with the dense mask. Run from two code trees in one device call for
an A/B of a change (``bench/results/ws-rows-pass-tried-h200-2026-11-29.jsonl``, whose
``parts_us`` name the main kernel ``k0``, the last part of its name).
Usage: PYTHONPATH=.:bench python3 bench/ws_chain_parts.py [spec@B:H:L:D:dtype ...]
"""

from __future__ import annotations

import json
import sys

import cupy as cp
import torch
import torch.nn.functional as F
from attention_timing import cupy_view
from global_rows_probe import random_qkv
from ws_trace import time_us

import stofc.kernels.attention.ws_cost as ws_cost
from stofc.masks import encode, to_dense
from stofc.runtime.attention import AttentionOp
from stofc.targets import detect

DEFAULT = ["longformer:window=256,global=16@1:12:4096:64:float16",
           "longformer:window=256,global=16@1:4:8192:64:float16",
           "longformer:window=256,global=16@1:12:8192:64:float16",
           "global:first=16@2:12:16384:64:float16"]


def _parts(bound, stream) -> list:
    """Each launch of the chain timed alone: [(launch, us), ...], the main kernel first."""
    chain = []
    b = bound
    while b is not None:
        chain.append(b)
        b = b.then
    nexts = [b.then for b in chain]
    out = []
    try:
        for b in chain:
            b.then = None
        for b in chain:
            # "main", then each later launch by its entry's suffix ("combine", ...)
            name = b.kernel.name[len(chain[0].kernel.name) + 1:] or "main"
            out.append((name, round(time_us(lambda b=b: b.launch(stream), stream, reps=100), 2)))
    finally:
        for b, n in zip(chain, nexts, strict=True):
            b.then = n
    return out


def main() -> int:
    cases = sys.argv[1:] or DEFAULT
    profile = detect()
    stream = cp.cuda.Stream(non_blocking=True)
    all_consumers = ws_cost.CONSUMERS
    for case in cases:
        spec, shape = case.split("@")
        B, H, L, D, dtype, (q, k, v) = random_qkv(shape)
        fmt = encode(spec, L)
        allowed = torch.from_numpy(to_dense(fmt)).cuda()
        ref = F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)),
                                             attn_mask=allowed).transpose(1, 2)
        del allowed
        row: dict = {"case": case, "gpu": torch.cuda.get_device_name()}
        pick = ws_cost.ws_config(fmt, profile, batch=B, heads=H, head_dim=D)
        row["pick"] = pick.describe() if pick else None
        for consumers in all_consumers:
            ws_cost.CONSUMERS = (consumers,)
            try:
                cfg = ws_cost.ws_config(fmt, profile, batch=B, heads=H, head_dim=D)
            finally:
                ws_cost.CONSUMERS = all_consumers
            if cfg is None:
                continue
            out = torch.full_like(q, float("nan"))
            torch.cuda.synchronize()
            bound = AttentionOp(fmt, cfg, dtype, D, profile).bind(
                *(cupy_view(x) for x in (q, k, v, out)), layout="bshd")
            us = [round(time_us(lambda b=bound: b.launch(stream), stream, reps=100), 2)
                  for _ in range(2)]
            stream.synchronize()
            err = float((out.float() - ref).norm() / ref.norm())
            row[f"c{consumers}"] = {"config": cfg.describe(), "us": us, "relerr": round(err, 6),
                                    "nan": bool(torch.isnan(out).any()),
                                    "parts_us": _parts(bound, stream)}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
