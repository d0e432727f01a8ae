"""Launch FlashAttention-4 (its SM90 path) a few times on one shape (a driver for ncu, to
profile the anchor with the same sections as ``ws_ncu_one.py`` profiles stofc's pick).

Usage: PYTHONPATH=. ncu ... python3 bench/fa4_ncu_one.py MASK L B H D DTYPE
MASK: dense or causal. Needs FA4 in /tmp/fa4site (../shared/scripts/fa4-wheel-parts.sh).
"""

from __future__ import annotations

import os
import site
import sys

if os.path.isdir("/tmp/fa4site"):
    site.addsitedir("/tmp/fa4site")

import torch
from flash_attn.cute.interface import flash_attn_func


def main() -> None:
    mask, L, B, H, D, dtype = sys.argv[1:7]
    L, B, H, D = int(L), int(B), int(H), int(D)
    dt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=dt) for _ in range(3))
    for _ in range(5):
        flash_attn_func(q, k, v, causal=mask == "causal")
    torch.cuda.synchronize()
    print("fa4", mask, L, B, H, D, dtype)


if __name__ == "__main__":
    main()
