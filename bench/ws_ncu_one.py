"""Launch the selector's warp-specialised pick a few times (a driver for ncu).

Usage: PYTHONPATH=. ncu ... python3 bench/ws_ncu_one.py MASK L B H D DTYPE [CONSUMERS]
"""

from __future__ import annotations

import sys
from dataclasses import replace

import cupy as cp
import numpy as np

from stofc.kernels.attention.ws_cost import ws_config
from stofc.kernels.attention.ws_plan import WS_BLOCKS_PER_SM, default_split
from stofc.masks import encode
from stofc.runtime.attention import AttentionOp
from stofc.targets import detect


def main() -> None:
    mask, L, B, H, D, dtype = sys.argv[1:7]
    L, B, H, D = int(L), int(B), int(H), int(D)
    profile = detect()
    fmt = encode(mask, L)
    cfg = ws_config(fmt, profile, batch=B, heads=H, head_dim=D)
    assert cfg is not None
    if len(sys.argv) > 7:
        consumers = int(sys.argv[7])
        cfg = replace(cfg, warps=4 * (consumers + 1), min_blocks=WS_BLOCKS_PER_SM[consumers],
                      pingpong=cfg.pingpong and consumers > 1,
                      split=default_split(fmt, batch=B, heads=H, sm_count=profile.sm_count,
                                          consumers=consumers))
    rng = np.random.default_rng(0)
    def rand():
        x = rng.standard_normal((B, L, H, D)).astype(np.float32)
        if dtype == "bfloat16":                  # truncated to bfloat16 bit patterns
            return cp.asarray((x.view(np.uint32) >> 16).astype(np.uint16))
        return cp.asarray(x.astype(np.float16))

    q, k, v = rand(), rand(), rand()
    out = cp.zeros_like(q)
    op = AttentionOp(fmt, cfg, dtype, D, profile)
    bound = op.bind(q, k, v, out)
    stream = cp.cuda.Stream(non_blocking=True)
    for _ in range(5):
        bound.launch(stream)
    stream.synchronize()
    print(op.family.describe(cfg))


if __name__ == "__main__":
    main()
