"""Fit and check the one-consumer ws cost (``ws_cost.D64_COSTS[1]``, ``ONE_CONSUMER_PACE``)
against a ``bench/ws_variants.py`` run with the ``c1x3*`` and ``cN*`` columns. No GPU needed.

One consumer's blocks run three to an SM, so the walk term is per SM (``ws_balance.sm_walk_ns``):
each block's load at the pace of three sharing the SM, then ONE_CONSUMER_PACE once two or one
still walk. The measured times are put on the H100 calibration scale of the other counts by
the median measured / estimated of the run's two-, three- and four-consumer columns (the
constants of those counts were fitted on H100 runs; the run is an H200's). ``--fit`` grid-
searches (entry ns, part-tile ns, wave us, the two paces) for the least mean squared log
ratio; without it the report prints, per shape and mask, the selector's pick (its config and
the measured time of that column) against the fastest column measured.

Usage: PYTHONPATH=. python3 bench/ws_fit_one_consumer.py bench/results/ws-variants-c1x3-h200-2026-11-29.jsonl [--fit]
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import numpy as np
from attention_timing import MASKS

from stofc.kernels.attention import AttentionConfig
from stofc.kernels.attention import ws_cost as wc
from stofc.kernels.attention.residue import split_format
from stofc.kernels.attention.ws_balance import COMBINE_US, dealt_loads, sm_walk_ns, ws_grid_blocks
from stofc.kernels.attention.ws_plan import WS_BLOCKS_PER_SM, consumers_of, plan_ws
from stofc.masks import encode
from stofc.targets import get_profile

# column -> (consumers, fixed split or None for ws_split's, turns)
COLUMNS = {"c1x3_sp0": (1, 0, False), "c1x3_sp16": (1, 16, False), "c1x3_sp32": (1, 32, False),
           "c1x3_s2sp16": (1, 16, False), "c4dpp": (4, None, True), "c4dnp": (4, None, False),
           "c3dnp": (3, None, False), "c2dpp": (2, None, True)}
PROFILE = get_profile("h200")


def _config(fmt, period: int, consumers: int, split: int | None, turns: bool, B: int, H: int,
            L: int) -> AttentionConfig:
    cfg = AttentionConfig("ws", 64, 16, 4 * (consumers + 1), wc.ws_stages(64, consumers), 1,
                          min_blocks=WS_BLOCKS_PER_SM[consumers], mma="wgmma", pingpong=turns,
                          period=period)
    if split is not None:
        return replace(cfg, split=split)
    s, rows = wc.ws_split(split_format(fmt, period), PROFILE, consumers=consumers,
                          batch=B * period, heads=H, seq_len=-(-L // period), head_dim=64)
    return replace(cfg, split=s, split_rows=rows)


def load(path: str):
    """(case, mask, column, fmt, B, H, L, config, measured us) of every timed column."""
    out = []
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    for r in rows:
        B, H, L = (int(x) for x in r["case"].split(":")[:3])
        fmt = encode(MASKS.get(r["mask"], r["mask"]), L)
        period = (wc.ws_config(fmt, PROFILE, batch=B, heads=H, head_dim=64).period
                  if r["mask"] == "dilated" else 1)
        for col, (c, split, turns) in COLUMNS.items():
            if isinstance(r.get(col), list):
                out.append((r["case"], r["mask"], col, fmt, B, H, L,
                            _config(fmt, period, c, split, turns, B, H, L), r[col][2]))
    return out


def _estimate(rec) -> float:
    _, _, _, fmt, B, H, L, cfg, _ = rec
    return wc.ws_estimate(fmt, PROFILE, cfg, batch=B, heads=H, seq_len=L, head_dim=64)


def _dealt(plan, flag: np.ndarray, run: int, heads: int, batch: int):
    """Each block's dealt sum of a per-entry ``flag`` over a run of ``run`` rows, and the
    per-head per-item sums."""
    cum = np.concatenate([[0.0], np.cumsum(flag)])
    per = []
    for h in range(plan.num_heads):
        it = plan.items[h]
        ok = (it[:, 0] >= 0) & (it[:, 0] * plan.rows < run)
        per.append(np.where(ok, cum[it[:, 2]] - cum[it[:, 1]], 0.0))
    grid = ws_grid_blocks(PROFILE, 1)
    return dealt_loads(plan, per, run, heads=heads, batch=batch, sm_count=grid), per


def fit(recs, scale: float) -> None:
    """Grid search of D64_COSTS[1] and ONE_CONSUMER_PACE on the one-consumer columns."""
    feats = []
    for _, _, _, fmt, B, H, L, cfg, us in (r for r in recs if consumers_of(r[7].warps) == 1):
        walked, b, n = fmt, B, L
        if cfg.period > 1:
            walked, b, n = split_format(fmt, cfg.period), B * cfg.period, -(-L // cfg.period)
        plan = plan_ws(walked, split_tiles=cfg.split, consumers=1, split_rows=cfg.split_rows)
        live, _, masked = wc._entry_flags(plan, n)
        lb, per = _dealt(plan, live, n, H, b)
        mb, _ = _dealt(plan, masked, n, H, b)
        works = sum(int((x > 0).sum()) for x in per) * (H if plan.num_heads == 1 else 1) * b
        feats.append((lb, mb, math.ceil(works / ws_grid_blocks(PROFILE, 1)),
                      COMBINE_US if plan.splits else 0.0, us / scale))
    speed = wc.CALIBRATION_SM_TFLOPS / (PROFILE.fp16_tflops / PROFILE.sm_count)
    launch = wc.D64_COSTS[4].launch_us
    best = None
    for f1, f2 in ((a, b) for a in (0.33, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0)
                   for b in (0.67, 0.75, 0.85, 1.0)):
        for entry in np.arange(800.0, 2000.0, 25.0):
            for part in range(0, 601, 100):
                for wave in (0.0, 0.69, 1.5, 3.0):
                    r = np.array([(sm_walk_ns(entry * lb + part * mb, 3, PROFILE.sm_count, (f1, f2))
                                   * 1e-3 * speed + w * wave + launch + comb) / m
                                  for lb, mb, w, comb, m in feats])
                    loss = float(np.mean(np.log(r) ** 2))
                    if best is None or loss < best[0]:
                        best = (loss, entry, part, wave, f1, f2, r.min(), r.max())
    assert best is not None
    loss, entry, part, wave, f1, f2, lo, hi = best
    print(f"EntryCost({entry:.0f}, 0, {part:.0f}, {wave:.2f}), ONE_CONSUMER_PACE ({f1:.2f}, "
          f"{f2:.2f}): mean sq log {loss:.4f}, estimate / measured {lo:.2f}-{hi:.2f}")


def report(recs, scale: float) -> None:
    """The selector's pick per shape and mask against the fastest column measured."""
    by_row: dict[tuple[str, str], list] = {}
    for r in recs:
        by_row.setdefault((r[0], r[1]), []).append(r)
    regrets = []
    print("| case | mask | pick | estimate / measured | pick us | fastest | us | regret |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (case, mask), rs in by_row.items():
        fmt, B, H = rs[0][3], rs[0][4], rs[0][5]
        pick = wc.ws_config(fmt, PROFILE, batch=B, heads=H, head_dim=64)
        match = [r for r in rs if (r[7].warps, r[7].split, r[7].split_rows, r[7].pingpong)
                 == (pick.warps, pick.split, pick.split_rows, pick.pingpong)]
        fastest = min(rs, key=lambda r: r[8])
        if not match:
            print(f"| {case} | {mask} | {pick.describe()} (not measured) | | | {fastest[2]} | "
                  f"{fastest[8]:.1f} | |")
            continue
        m = match[0]
        regret = m[8] / fastest[8] - 1.0
        regrets.append(regret)
        print(f"| {case} | {mask} | {m[2]} | {_estimate(m) * scale / m[8]:.2f} | {m[8]:.1f} | "
              f"{fastest[2]} | {fastest[8]:.1f} | {100 * regret:.1f}% |")
    print(f"\nregret of the picks measured: mean {100 * np.mean(regrets):.1f}%, "
          f"worst {100 * np.max(regrets):.1f}% over {len(regrets)} rows")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--fit", action="store_true")
    args = ap.parse_args()
    recs = load(args.path)
    ratios = [r[8] / _estimate(r) for r in recs if consumers_of(r[7].warps) > 1]
    scale = float(np.median(ratios))
    print(f"two to four consumers: measured / estimated median {scale:.3f} "
          f"({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} runs)")
    if args.fit:
        fit(recs, scale)
    else:
        report(recs, scale)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
