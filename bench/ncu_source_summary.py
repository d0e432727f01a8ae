"""Summarise ncu's source page (SASS, warp-stall sampling) of one kernel.

Input: ``ncu -i X.ncu-rep --page source --csv --print-source sass`` (optionally gzipped).
Prints the stall samples by opcode, by window of 40 instructions, by execution count (an
instruction run once per work item has a different count from one run once per step),
and the ``--top`` most sampled instructions with their three largest stall reasons.
Usage: python3 bench/ncu_source_summary.py SRC.csv[.gz] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    opener = gzip.open if args.source.endswith(".gz") else open
    with opener(args.source, "rt") as f:
        rows = list(csv.reader(f))
    header, data = rows[1], rows[2:]                 # row 0 names the kernel
    col = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = [_num(r[col[SAMPLES]]) for r in data]
    executed = [_num(r[col[EXECUTED]]) for r in data]
    sass = [r[col["Source"]] for r in data]
    total = sum(samples) or 1.0
    print(f"{rows[0][1] if len(rows[0]) > 1 else ''}: {len(data)} instructions, "
          f"{total:.0f} samples")

    by_op: collections.Counter[str] = collections.Counter()
    runs: collections.Counter[str] = collections.Counter()
    for s, e, text in zip(samples, executed, sass, strict=True):
        m = re.match(r"\s*(@!?U?P\w+\s+)?([A-Z0-9_]+)", text)
        op = m.group(2) if m else "?"
        by_op[op] += s
        runs[op] += e
    print("by opcode: share of samples, instructions executed")
    for op, s in by_op.most_common(25):
        print(f"  {op:12s} {s / total * 100:5.1f}% {runs[op]:12.0f}")

    print("by window of 40 instructions (>= 2% of samples)")
    for a in range(0, len(samples), 40):
        w = sum(samples[a:a + 40])
        if w / total >= 0.02:
            print(f"  {a:5d}-{a + 39:5d} {w / total * 100:5.1f}%  executed up to "
                  f"{max(executed[a:a + 40]):.0f}")

    by_count: collections.Counter[float] = collections.Counter()
    for s, e in zip(samples, executed, strict=True):
        by_count[round(e, -2)] += s
    print("by execution count (rounded to 100)")
    for e, s in sorted(by_count.items(), key=lambda x: -x[1])[:12]:
        print(f"  {e:10.0f} {s / total * 100:5.1f}%")

    print(f"top {args.top} instructions")
    order = sorted(range(len(data)), key=lambda i: -samples[i])[:args.top]
    for i in order:
        reasons = sorted(((_num(data[i][col[h]]), h[6:]) for h in stalls), reverse=True)[:3]
        why = " ".join(f"{n}:{v:.0f}" for v, n in reasons if v)
        print(f"  {i:5d} {samples[i] / total * 100:5.2f}% ex={executed[i]:9.0f} "
              f"{sass[i].strip()[:64]:64s} {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
