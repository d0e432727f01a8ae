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

``--mha RUN.json ...`` fits the head_dim-128 costs (``D128_COSTS``: two consumers, no
per-warpgroup term) instead, from the ws rows of ``bench/mha_hopper.py`` runs at the ring
depth ``--stages`` (``--head-dim 64 --mha-consumers 2|3``: head_dim 64's in the same form,
the per-warpgroup term left out), in the estimator's own form (:func:`~stofc.kernels.attention.ws_cost.
ws_estimate`: per-SM entry and part-tile sums, waves of items, LAUNCH_US), weighted by
relative error.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import numpy as np
from attention_timing import MASKS as VARIANT_MASKS  # ws_variants.py's mask names

from stofc.kernels.attention.ws_cost import (
    COMBINE_US,
    LAUNCH_US,
    _entry_flags,
    dealt_loads,
    ws_pingpong,
)
from stofc.kernels.attention.ws_plan import SKIP, default_split, plan_ws
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


def mha_masks() -> dict[str, str]:
    """bench/mha_hopper.py's mask names -> specs (read from its MASKS table)."""
    src = (Path(__file__).parent / "mha_hopper.py").read_text()
    body = re.search(r"MASKS = \{(.*?)\n\}", src, re.S)
    assert body is not None, "mha_hopper.py has no MASKS table"
    return dict(re.findall(r'^\s*"(\w+)": \("([^"]+)"', body.group(1), re.M))


def d128_features(spec: str, length: int, split: int, runs: int, consumers: int = 2,
                  active: bool = False, busiest: bool = False) -> list[float]:
    """[entries, part tiles] per SM and the waves of one launch of ``runs`` (batch x heads)
    copies of the walk, in ws_estimate's form for the head_dim fitted: ``busiest`` (head_dim
    64) those of the block with the most entries under the kernel's deal
    (:func:`~stofc.kernels.attention.ws_cost.dealt_loads`), else the mean over the SMs
    (head_dim 128's form); with ``active``, [entries, active warpgroup-tiles, part tiles,
    waves]."""
    plan = plan_ws(encode(spec, length), split_tiles=split, consumers=consumers)
    live, act, masked = _entry_flags(plan, length)
    cum_l = np.concatenate([[0.0], np.cumsum(live)])
    cum_a = np.concatenate([[0.0], np.cumsum(act)])
    cum_m = np.concatenate([[0.0], np.cumsum(masked)])
    items = plan.items[0]
    ok = (items[:, 0] >= 0).astype(np.float64)
    share = ok        # a shared chunk costs its whole walk, as in ws_cost._item_ns
    e = (cum_l[items[:, 2]] - cum_l[items[:, 1]]) * share
    m = (cum_m[items[:, 2]] - cum_m[items[:, 1]]) * share
    a = (cum_a[items[:, 2]] - cum_a[items[:, 1]]) * share
    per_item = [e, a, m] if active else [e, m]
    waves = float(math.ceil(int((e > 0).sum()) * runs / SMS))
    if not busiest:
        return [float(x.sum()) * runs / SMS for x in per_item] + [waves]
    loads = [dealt_loads(plan, [x], length, heads=runs, batch=1, sm_count=SMS) for x in per_item]
    block = int(np.argmax(loads[0]))
    return [float(x[block]) for x in loads] + [waves]


def fit_mha(paths: list[str], stages: int, head_dim: int = 128, consumers: int = 2) -> int:
    """Fit ``head_dim``'s costs for ``consumers`` consumer warpgroups from the ws rows of
    ``bench/mha_hopper.py`` runs at ring depth ``stages``."""
    masks = mha_masks()
    X, y, labels = [], [], []
    for path in paths:
        with open(path) as f:
            rows = json.load(f)["rows"]
        for r in rows:
            b, h, length, d, _ = r["case"].split(":")
            if int(d) != head_dim:
                continue
            for c in r["stofc"]:
                cfg = c["config"]
                if (c["label"] != "ws" or "ms" not in c or f"stages={stages} " not in cfg
                        or "keys/step=64 " not in cfg
                        or f"rows/block={64 * consumers} " not in cfg):
                    continue
                split = re.search(r"split=(\d+)", cfg)
                X.append(d128_features(masks[r["mask"]], int(length),
                                       int(split.group(1)) if split else 0, int(b) * int(h),
                                       consumers, busiest=head_dim <= 64))
                y.append(c["ms"] * 1e3)
                labels.append(f"{r['case']} {r['mask']} ({c['label']})")
    return _fit_costs(X, y, labels, f"head_dim {head_dim}, {consumers} consumers, stages {stages}")


def _fit_costs(X: list[list[float]], y: list[float], labels: list[str], what: str,
               fixed: list[float] | None = None, launch: bool | float = False,
               wave: float | None = None) -> int:
    """Least squares (relative error) of the estimator's form, the per-warpgroup term only
    where ``X`` has its column (``--active``); prints the constants.
    ``fixed``: each run's fixed microseconds beyond the launch constant (the combine
    launch's COMBINE_US where rows are split), subtracted before the fit. ``launch``: fit
    the launch constant too (head_dim 64's ``launch_us``: the fitted value less
    BLOCK_SHORT_BIAS_US), else LAUNCH_US. ``wave``: hold the per-wave term at this value
    (where the runs' waves and the launch constant are collinear and a free fit goes
    negative). ``launch`` a number: hold the launch constant at it (fitted on short runs)."""
    A, t = np.asarray(X), np.asarray(y)
    terms = A.shape[1] - 1                  # cost columns before the waves (2, or 3: active)
    base = np.asarray(fixed) if fixed is not None else np.zeros(len(t))
    if wave is not None:
        base = base + wave * A[:, terms]
        A = A[:, :terms]
    if launch is True:
        A = np.column_stack([A, np.ones(len(t))])
    else:
        base = base + (LAUNCH_US if launch is False else float(launch))
    w = 1.0 / t
    coef, *_ = np.linalg.lstsq(A * w[:, None], (t - base) * w, rcond=None)
    entry, masked = coef[0], coef[terms - 1]
    act = coef[1] if terms == 3 else 0.0
    free = terms if wave is not None else terms + 1
    wave = wave if wave is not None else coef[terms]
    const = (f"launch {coef[free]:.2f} us" if launch is True else
             "+ LAUNCH_US" if launch is False else f"launch {float(launch):.2f} us held")
    print(f"{what}: EntryCost({entry * 1e3:.0f}, {act * 1e3:.0f}, {masked * 1e3:.0f}, "
          f"{wave:.2f})  [ns per entry / active warpgroup-tile / part tile per SM, us per wave; "
          f"{const}"
          f"{' + COMBINE_US where split' if fixed is not None else ''}]")
    for label, got, want in zip(labels, A @ coef + base, t, strict=True):
        print(f"    {label:40s} measured {want:8.1f} us  model {got:8.1f}  ({got / want:.2f})")
    return 0


def fit_variants(paths: list[str], column: str, consumers: int, head_dim: int = 128,
                 exclude: str = "", launch: bool | float = False,
                 wave: float | None = None, active: bool = False) -> int:
    """Fit from ``bench/ws_variants.py`` lines: the ``column`` variant's time of each
    ``head_dim`` case (run at the split ``default_split`` gives ``consumers``: fit with the
    code that ran, ``exclude`` the runs it no longer gives), less COMBINE_US where rows are
    split (the estimator charges the combine launch that)."""
    masks = {**FAMILIES, **VARIANT_MASKS}
    X, y, labels, fixed = [], [], [], []
    for path in paths:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.startswith("{")]
        for r in rows:
            b, h, length, d, _ = r["case"].split(":")
            if int(d) != head_dim or (exclude and re.search(exclude, f"{r['case']} {r['mask']}")):
                continue
            fmt = encode(masks[r["mask"]], int(length))
            split = default_split(fmt, batch=int(b), heads=int(h), sm_count=SMS,
                                  consumers=consumers)
            plan = plan_ws(fmt, split_tiles=split, consumers=consumers)
            v = r.get(column)
            if v is None and column.startswith(f"c{consumers}"):   # the turns ws_pingpong takes
                v = r.get(f"{column}{'pp' if ws_pingpong(plan) else 'np'}")
            if not isinstance(v, list):
                continue
            X.append(d128_features(masks[r["mask"]], int(length), split, int(b) * int(h),
                                   consumers, active, busiest=head_dim <= 64))
            fixed.append(COMBINE_US if plan.splits else 0.0)
            y.append(v[2])
            labels.append(f"{r['case']} {r['mask']}")
    return _fit_costs(X, y, labels, f"head_dim {head_dim}, {consumers} consumers ({column})",
                      fixed, launch, wave)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl", nargs="?")
    ap.add_argument("--variant", default="s3", help="the ring depth of the variants fitted")
    ap.add_argument("--mha", nargs="+", help="fit D128_COSTS from bench/mha_hopper.py runs")
    ap.add_argument("--stages", type=int, default=2, help="--mha: the ring depth fitted")
    ap.add_argument("--head-dim", type=int, default=128,
                    help="--mha: the head_dim fitted (64: D64_COSTS in the same form)")
    ap.add_argument("--mha-consumers", type=int, default=2, help="--mha: the consumer count")
    ap.add_argument("--variants", nargs="+",
                    help="fit one consumer count's costs (--head-dim) from ws_variants.py lines")
    ap.add_argument("--column", default="c3q",
                    help="--variants: the variant fitted ('cN': cNpp or cNnp, as ws_pingpong "
                         "takes turns on each walk)")
    ap.add_argument("--consumers", type=int, default=3, help="--variants: its consumer count")
    ap.add_argument("--launch", action="store_true",
                    help="--variants: fit the per-launch constant too (D64_COSTS' launch_us)")
    ap.add_argument("--active", action="store_true",
                    help="--variants: fit a cost per active warpgroup-tile too (walks whose "
                         "warpgroups skip many tiles, without ping-pong turns)")
    ap.add_argument("--launch-us", type=float, default=None,
                    help="--variants: hold the launch constant at this many us (short runs')")
    ap.add_argument("--wave", type=float, default=None,
                    help="--variants: hold the per-wave term at this many us")
    ap.add_argument("--exclude", default="",
                    help="--variants: skip 'case mask' labels matching this regex (runs whose "
                         "split default_split no longer gives)")
    args = ap.parse_args()
    if args.variants:
        launch = args.launch_us if args.launch_us is not None else args.launch
        return fit_variants(args.variants, args.column, args.consumers, args.head_dim,
                            args.exclude, launch, args.wave, args.active)
    if args.mha:
        return fit_mha(args.mha, args.stages, args.head_dim, args.mha_consumers)
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
