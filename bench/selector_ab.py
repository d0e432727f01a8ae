"""The selector's picks under two head_dim-64 ws cost models, timed side by side (a probe).

For each case and mask, ``select_kernel`` runs once with the ws cost constants in the tree
and once with ``--old-d64`` (and ``--old-combine``) swapped into
:mod:`stofc.kernels.attention.ws_cost` (the memo cleared between). Where the two picks
differ, both configs are timed on the same inputs in the same call and checked against
SDPA in float32; a JSON line per case and mask: the two configs and ``[TF/s, relative
error, us]`` of each. The old pick is rebuilt with today's ``default_split``.
Usage: PYTHONPATH=. python3 bench/selector_ab.py --cases B:H:L:D ... --masks ...
    [--old-d64 "611,77,114,3.36;632,123,49,5.32"] [--old-combine 0]
"""

from __future__ import annotations

import argparse
import json

import cupy as cp
import torch
import torch.nn.functional as F
from attention_timing import MASKS, check_and_time

import stofc.kernels.attention.select as select_mod
import stofc.kernels.attention.ws_cost as ws_cost
from stofc.kernels.attention import select_kernel
from stofc.masks import encode, to_dense
from stofc.runtime.attention import AttentionOp
from stofc.targets import detect


def pick(fmt, profile, B: int, H: int, L: int, D: int, costs=None, combine=None):
    """select_kernel's config with ``costs`` / ``combine`` swapped in (None: the tree's)."""
    saved = (ws_cost.D64_COSTS, ws_cost.COMBINE_US)
    try:
        if costs is not None:
            ws_cost.D64_COSTS, ws_cost.COMBINE_US = costs, combine
        select_mod._MEMO.clear()
        return select_kernel(fmt, profile, batch=B, heads=H, seq_len=L, head_dim=D).config
    finally:
        ws_cost.D64_COSTS, ws_cost.COMBINE_US = saved
        select_mod._MEMO.clear()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1:12:8192:64 8:12:512:64")
    ap.add_argument("--masks", default="dense,causal,local64,local256,longformer,bigbird")
    ap.add_argument("--old-d64", default="611,77,114,3.36;632,123,49,5.32",
                    help="EntryCost fields for two and three consumers, ';'-separated")
    ap.add_argument("--old-combine", type=float, default=0.0)
    args = ap.parse_args()
    old = {c: ws_cost.EntryCost(*map(float, part.split(",")))
           for c, part in zip((2, 3), args.old_d64.split(";"), strict=True)}
    profile = detect()
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    for case in args.cases.split():
        B, H, L, D = map(int, case.split(":"))
        q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=torch.float16) for _ in range(3))
        qc, kc, vc = (cp.asarray(x) for x in (q, k, v))
        for mask in args.masks.split(","):
            fmt = encode(MASKS.get(mask, mask), L)
            configs = {"old": pick(fmt, profile, B, H, L, D, old, args.old_combine),
                       "new": pick(fmt, profile, B, H, L, D)}
            row: dict = {"case": case, "mask": mask,
                         **{f"{k}_config": c.describe() for k, c in configs.items()}}
            if configs["old"] != configs["new"]:
                dense = torch.from_numpy(to_dense(fmt)).cuda()
                nnz = int(dense.sum())
                ref = F.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)),
                                                     attn_mask=dense).transpose(1, 2)
                del dense
                for name, cfg in configs.items():
                    op = AttentionOp(fmt, cfg, "float16", D, profile)
                    out = torch.full_like(q, float("nan"))
                    bound = op.bind(qc, kc, vc, cp.asarray(out))
                    row[name] = check_and_time(bound, stream, out, ref, 4 * B * H * D * nnz)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
