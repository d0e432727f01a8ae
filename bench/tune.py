"""Tune BERT-base (12 layers) for (B, L) = (16, 2048) with a BigBird mask: cold, then warm.

The model is the plan module's synthetic BERT-base layer chain x 12 (hidden
768, 12 heads, FFN 3072, post-LN, fp16); the mask BigBird (block 64, window 3,
global 2, random 3) encoded for L = 2048. The analytical plan
(``build_plan``) is tuned by ``tune_plan_buckets`` on the GPU present:

* cold: a fresh kernel cache and tuning database (``STOFC_CACHE_DIR`` points at
  an empty directory), the wall time of the whole call including starting
  the measurement worker and the compile pool (target <= 60 s);
* warm: the same call again with the same database and cache (target <= 5 s;
  nothing may be measured).

Default vs tuned per segment: the median CUDA-event time of each segment of
the default chain (its analytical config) and of the tuned chain (its
verified winner), as the tuner measured them (graphs of the segment over
inputs rotated past L2); totals are one layer's chain x 12. Writes
``tune-<gpu>-<date>.json`` and ``.md`` to ``--out``.

Usage: PYTHONPATH=. python3 bench/tune.py --out DIR [--budget 40]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MASK = "bigbird:block=64,window=3,global=2,random=3"


class PrintReporter:
    """Stage lines, every 25th progress event, warnings and the summary, to stdout."""

    def __init__(self) -> None:
        self.count = 0

    def stage(self, name, message):
        print(f"[{name}] {message}", flush=True)

    def progress(self, event):
        self.count += 1
        if self.count % 25 == 0:
            best = "-" if event.best_ms is None else f"{event.best_ms:.4f} ms"
            print(f"  {event.stage}: {event.segment} {event.done}/{event.planned} best {best} "
                  f"elapsed {event.elapsed_s:.1f} s", flush=True)

    def warning(self, message):
        print(f"  warning: {message}", flush=True)

    def summary(self, rows):
        for r in rows:
            print(f"  {r.segment:34s} x{r.occurrences} default {r.default_ms} tuned "
                  f"{r.tuned_ms} ({r.source}) {r.config}", flush=True)


def run_once(plan, layers, fmt, profile, *, batch, seq_len, budget, db_path):
    from stofc.tune.db import TuningDatabase
    from stofc.tune.plan_tuner import tune_plan_buckets

    started = time.monotonic()
    with TuningDatabase.open(db_path) as db:
        tuning = tune_plan_buckets(plan, layers, fmt, profile, batch=batch, seq_lens=(seq_len,),
                                   budget_s=budget, db=db, reporter=PrintReporter())
    return tuning, time.monotonic() - started


def _ms(value):
    return "-" if value is None else f"{value:.4f}"


def write_markdown(res: dict, path: Path) -> None:
    n = res["layers"]
    lines = [f"# Tuning BERT-base x{n} on {res['gpu']} ({res['date']})", "",
             f"(B, L) = ({res['batch']}, {res['seq_len']}), fp16, mask `{res['mask']}`, "
             f"budget {res['budget_s']} s.", "",
             "| run | wall time | target | measured | memo hits | database hits | faults |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, target in (("cold", 60), ("warm", 5)):
        r = res[name]
        ok = "met" if r["wall_s"] <= target else "MISSED"
        lines.append(f"| {name} | {r['wall_s']:.1f} s | <= {target} s ({ok}) | {r['measured']} | "
                     f"{r['memo_hits']} | {r['db_hits']} | {r['faults']} |")
    g = res["chain"]
    lines += ["", f"Default scheme `{g['default_scheme']}`, tuned scheme `{g['tuned_scheme']}`.",
              "", "Per segment, one layer (median ms, CUDA events over graphs of the segment, "
              "inputs rotated past L2):", "",
              "| chain | segment | family | default config ms | tuned ms | config |",
              "| --- | --- | --- | --- | --- | --- |"]
    for kind in ("default", "tuned"):
        for s in g[f"{kind}_segments"]:
            ms = s["default_ms"] if kind == "default" else s["tuned_ms"]
            lines.append(f"| {kind} | {s['label']} | {s['family']} | {_ms(s['default_ms'])} | "
                         f"{_ms(ms) if kind == 'tuned' else '-'} | `{s['config']}` |")
    d, t = g["default_chain_ms"], g["tuned_chain_ms"]
    lines += ["", f"Per layer: default {_ms(d)} ms, tuned {_ms(t)} ms; x{n} layers: default "
              f"{_ms(d * n if d else None)} ms, tuned {_ms(t * n if t else None)} ms"
              + (f" ({d / t:.2f}x)." if d and t else "."), ""]
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--budget", type=float, default=40.0)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--cache", default=None, help="cache dir (default: a fresh temp dir)")
    args = parser.parse_args()
    cache = Path(args.cache or tempfile.mkdtemp(prefix="stofc-tune-cache-"))
    os.environ["STOFC_CACHE_DIR"] = str(cache)    # cold: empty kernel cache and database

    from stofc.masks import encode
    from stofc.plan.build import build_plan
    from stofc.plan.synthetic import bert_layer
    from stofc.targets import detect
    from stofc.tune.device import present_gpu_name

    profile = detect()
    gpu = present_gpu_name() or profile.full_name
    layers = [bert_layer(768, 12, 3072, index=i) for i in range(args.layers)]
    fmt = encode(MASK, args.seq_len, tile=64)
    plan = build_plan(layers, fmt, profile, dtype="float16", max_seq_len=args.seq_len,
                      batch=args.batch)
    print("\n".join(plan.summary()[:1]), flush=True)
    db_path = cache / "tuning.sqlite"
    res: dict = {"gpu": gpu, "profile": profile.name, "date": datetime.date.today().isoformat(),
                 "batch": args.batch, "seq_len": args.seq_len, "layers": args.layers,
                 "mask": MASK, "budget_s": args.budget}
    plans: dict[str, object] = {}
    for name in ("cold", "warm"):
        print(f"== {name} run", flush=True)
        tuning, wall = run_once(plan, layers, fmt, profile, batch=args.batch,
                                seq_len=args.seq_len, budget=args.budget, db_path=db_path)
        s = tuning.stats
        res[name] = {"wall_s": wall, "measured": s.measured, "memo_hits": s.memo_hits,
                     "db_hits": s.db_hits, "faults": s.faults,
                     "measure_seconds": s.measure_seconds,
                     "stage1": tuning.groups[0].result.stage1.stopped,
                     "stage2": tuning.groups[0].result.stage2.stopped,
                     "stage1_decisions": [d.reason for d in tuning.groups[0].result.stage1.decisions]}
        print(f"== {name}: {wall:.1f} s, {s.measured} measured, {s.faults} faults, "
              f"{s.db_hits} db hits", flush=True)
        if name == "cold":
            group = tuning.groups[0]
            res["chain"] = {"default_scheme": group.default_scheme,
                            "tuned_scheme": group.tuned_scheme,
                            "default_segments": [asdict(x) for x in group.default_segments],
                            "tuned_segments": [asdict(x) for x in group.tuned_segments],
                            "default_chain_ms": group.default_chain_ms,
                            "tuned_chain_ms": group.tuned_chain_ms}
            res["tuned_plan"] = json.loads(tuning.plans[0][1].to_json())["layers"][0]
        plans[name] = tuning.plans
    res["warm_plan_equal"] = plans["warm"] == plans["cold"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = gpu.replace("NVIDIA ", "").replace(" ", "_").lower()
    stem = out / f"tune-{tag}-{res['date']}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))
    write_markdown(res, stem.with_suffix(".md"))
    print(stem.with_suffix(".md").read_text(), flush=True)


if __name__ == "__main__":
    main()
