"""Run one stofc attention config a few times (for ncu): spec L tile kind warp_m warps stages q_split gather.

Example: ncu --clock-control none -k regex:stofc_attn --launch-skip 2 --launch-count 1 \\
    python3 bench/profile_attention.py causal 4096 128 block 32 4 2 1 0
"""

from __future__ import annotations

import sys

import cupy as cp
import numpy as np

from stofc.kernels.attention import AttentionConfig
from stofc.masks import encode
from stofc.runtime.attention import AttentionOp
from stofc.targets import detect


def main() -> None:
    spec, L, tile, kind, warp_m, warps, stages, q_split, gather = sys.argv[1:10]
    L, tile = int(L), int(tile)
    cfg = AttentionConfig(kind, tile, int(warp_m), int(warps), int(stages), int(q_split),
                          bool(int(gather)))
    fmt = encode(spec, L, tile=tile)
    B, H, D = 4, 12, 64
    rng = np.random.default_rng(0)
    q, k, v = (cp.asarray(rng.standard_normal((B, H, L, D)).astype(np.float16)) for _ in range(3))
    out = cp.full_like(q, np.nan)
    op = AttentionOp(fmt, cfg, "float16", D, detect())
    bound = op.bind(q, k, v, out, layout="bhsd")
    for _ in range(4):
        bound.launch()
    cp.cuda.runtime.deviceSynchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(20):
        bound.launch()
    end.record()
    end.synchronize()
    print(f"{spec} L={L} {cfg.describe()}: {cp.cuda.get_elapsed_time(start, end) / 20:.4f} ms, "
          f"nan={bool(cp.isnan(out).any())}")


if __name__ == "__main__":
    main()
