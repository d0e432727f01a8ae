"""Fit the head_dim-64 cost model of the warp-specialised kernel (``stofc/kernels/attention/
ws_cost.py``, ``D64_COSTS``) to measured times. No GPU needed.

Input: the ``consumers`` rows of ``bench/ws_diag.py`` (a JSON line per case and mask with
the time of every variant). For each (case, mask) and consumer count the walk is rebuilt
with :func:`~stofc.kernels.attention.ws_plan.plan_ws` at the split the run used, and the
time is fitted by least squares as

    t = (ENTRY x entries + ACTIVE x active warpgroup-tiles + MASKED x part tiles) / SMs
        + WAVE x items / SMs

(entries: the merged walk's steps, which every warpgroup of a block takes; per-SM
nanoseconds; SMs = 132). Prints the constants and each case's predicted / measured ratio.

Usage: python3 bench/ws_calibrate.py bench/results/ws-diag-h100-2026-11-26.jsonl [--variant s3]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from stofc.kernels.attention.ws_plan import SKIP, plan_ws
from stofc.masks import encode

FAMILIES = {"dense": "dense", "causal": "causal", "local64": "sliding:window=64",
            "local256": "sliding:window=256", "longformer": "longformer:window=256,global=16",
            "bigbird": "bigbird:block=64,window=3,global=2,random=3,seed=0"}
SMS = 132


def features(spec: str, length: int, consumers: int, split: int, runs: int) -> list[float]:
    """[entries, active, masked, items] over ``runs`` (batch x heads) copies of the walk."""
    plan = plan_ws(encode(spec, length), split_tiles=split, consumers=consumers)
    parts = np.asarray(plan.entry_part[:-consumers]).reshape(-1, consumers)
    items = int((plan.items[0][:, 0] >= 0).sum())
    return [runs * float(parts.shape[0]), runs * float((parts != SKIP).sum()),
            runs * float((parts >= 0).sum()), runs * float(items)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl")
    ap.add_argument("--variant", default="s3", help="the ring depth of the variants fitted")
    args = ap.parse_args()
    with open(args.jsonl) as f:
        rows = [r for r in map(json.loads, f) if r.get("part") == "consumers"]
    for consumers in (2, 3):
        name = f"c{consumers}{args.variant}" if args.variant != "s2" else f"c{consumers}"
        X, y, labels = [], [], []
        for r in rows:
            v = r.get(name)
            if not isinstance(v, dict):
                continue
            b, h, length, _, _ = r["case"].split(":")
            X.append(features(FAMILIES[r["mask"]], int(length), consumers, v["split"],
                              int(b) * int(h)))
            y.append(v["us"])
            labels.append(f"{r['case']} {r['mask']}")
        A = np.asarray(X) / SMS
        coef, *_ = np.linalg.lstsq(A, np.asarray(y), rcond=None)
        entry, active, masked, wave = coef
        print(f"consumers={consumers} ({name}): EntryCost({entry * 1e3:.0f}, {active * 1e3:.0f}, "
              f"{masked * 1e3:.0f}, {wave:.2f})  [ns per entry / active / masked per SM, us "
              f"per wave]")
        for label, got, want in zip(labels, A @ coef, y, strict=True):
            print(f"    {label:34s} measured {want:8.1f} us  model {got:8.1f}  ({got / want:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
