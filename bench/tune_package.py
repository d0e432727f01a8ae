"""`stofc compile --tune` on the GPU, end to end, and what tuning buys the deployed package.

One device call (onnxruntime-gpu on PYTHONPATH for the timing part):

1. export HF BERT-base (bench/e2e.py's export: random weights, eager attention, 2048
   positions);
2. ``stofc compile MODEL --mask BIGBIRD --gpu auto --max-seq-len 2048`` (the analytical
   package) and ``stofc compile ... --tune --batch B --seq-len 128 --seq-len 512
   --seq-len 2048`` into a fresh tuning database and kernel cache (cold), then the same
   tuned compile again into a new directory with the same database (warm): wall times;
3. ``stofc verify --provider cuda`` of both packages;
4. both packages timed in ONNX Runtime (IOBinding, device-resident IO, medians) at
   (B, 128), (B, 512), (B, 2048), alternating default and tuned per repetition round so
   drift hits both alike: the speed-up of the tuned package per bucket.

Writes tune-package.json / .md under --out.
Usage: python3 bench/tune_package.py --out DIR [--batch 4] [--budget 120]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MASK = "bigbird:block=64,window=3,global=2,random=3,seed=0"


def stofc(*args: str, env: dict) -> tuple[float, str]:
    """Run the stofc CLI; (wall seconds, combined output). Raises on a non-zero exit."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "stofc", *args], env=env, text=True,
                          capture_output=True)
    wall = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    print(f"$ stofc {' '.join(args)}  ({wall:.1f} s, exit {proc.returncode})\n{out[-3000:]}",
          flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"stofc {args[0]} failed (exit {proc.returncode})")
    return wall, out


def time_pair(sessions: dict, feeds: dict, rounds: int = 7, per_round: int = 10) -> dict:
    """Median ms per session, rounds alternating between the sessions."""
    from stofc.package.bench import device_binding

    bindings = {}
    for name, sess in sessions.items():
        b = device_binding(sess, feeds)
        for _ in range(10):
            sess.run_with_iobinding(b)
        bindings[name] = b
    times: dict[str, list[float]] = {n: [] for n in sessions}
    for _ in range(rounds):
        for name, sess in sessions.items():
            for _ in range(per_round):
                t = time.perf_counter()
                sess.run_with_iobinding(bindings[name])
                times[name].append((time.perf_counter() - t) * 1e3)
    return {n: statistics.median(v) for n, v in times.items()}


def main() -> None:
    import e2e_models as e2e
    import numpy as np

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    parser.add_argument("--work", default="/tmp/stofc-tunepkg")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--budget", type=float, default=None)
    args = parser.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, STOFC_CACHE_DIR=str(work / "cache"))
    db = work / "tuning.sqlite"
    res: dict = {"mask": MASK, "batch": args.batch, "buckets": [128, 512, 2048]}

    def dump() -> None:
        (out / "tune-package.json").write_text(json.dumps(res, indent=1))

    src = work / "bert.onnx"
    if not src.exists():
        e2e.export_bert(src)
    common = ["--mask", MASK, "--gpu", "auto", "--max-seq-len", "2048", "--quiet"]
    res["compile_default_s"], _ = stofc("compile", str(src), *common, "-o",
                                        str(work / "default"), env=env)
    tune_args = ["--tune", "--batch", str(args.batch), "--db", str(db),
                 *(x for n in res["buckets"] for x in ("--seq-len", str(n)))]
    if args.budget:
        tune_args += ["--budget", str(args.budget)]
    res["compile_tune_cold_s"], _ = stofc("compile", str(src), *common, *tune_args, "-o",
                                          str(work / "tuned"), env=env)
    res["compile_tune_warm_s"], _ = stofc("compile", str(src), *common, *tune_args, "-o",
                                          str(work / "tuned-warm"), env=env)
    doc = json.loads((work / "tuned" / "plan.json").read_text())
    res["tuned_attention"] = [{"layer": a["layer"], "config": a["config"],
                               "variants": [(v["max_seq_len"], v["config"])
                                            for v in a["variants"]]}
                              for a in doc["attention"][:1]]
    dump()
    for name in ("default", "tuned"):
        _, text = stofc("verify", str(work / name), "--provider", "cuda", "--batch", "2",
                        "--seq-len", "512", env=env)
        res[f"verify_{name}"] = text.strip().splitlines()[-6:]
    dump()
    from stofc.frontend import load_model
    from stofc.package.load import load
    from stofc.package.verify import make_inputs

    graph = load_model(src)
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    sessions = {n: load(work / n, providers=providers) for n in ("default", "tuned")}
    rng = np.random.default_rng(0)
    res["timing"] = []
    for seq in res["buckets"]:
        feeds, _ = make_inputs(graph, args.batch, seq, rng)
        med = time_pair(sessions, feeds)
        row = {"B": args.batch, "L": seq, "default_ms": med["default"], "tuned_ms": med["tuned"],
               "speedup": med["default"] / med["tuned"]}
        res["timing"].append(row)
        print(json.dumps(row), flush=True)
        dump()
    lines = [f"# stofc compile --tune, BERT-base (HF export), {MASK}", "",
             "| step | wall s |", "| --- | --- |",
             f"| compile (analytical) | {res['compile_default_s']:.1f} |",
             f"| compile --tune, cold database and cache | {res['compile_tune_cold_s']:.1f} |",
             f"| compile --tune, warm database | {res['compile_tune_warm_s']:.1f} |", "",
             "| B | L | default package ms | tuned package ms | tuned speed-up |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['B']} | {r['L']} | {r['default_ms']:.3f} | {r['tuned_ms']:.3f} | "
              f"{r['speedup']:.3f}x |" for r in res["timing"]]
    (out / "tune-package.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    dump()


if __name__ == "__main__":
    main()
