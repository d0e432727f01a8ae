"""End to end on the GPU, in one run: stofc packages vs what a user could pick instead.

Models (``bench/e2e_models.py``): Hugging Face BERT-base and GPT-2-small, random
weights from the config, eager attention, 2048 positions, exported with
``torch.onnx.export`` (TorchScript, opset 17; ``input_ids`` + ``attention_mask`` ->
``last_hidden_state``). Masks: BigBird, Longformer, causal (GPT-2's packages AND them
with the model's own causal mask). For each model, mask and (B, L):

- stofc: ``compile_model`` -> package (once per model and mask), ``verify_package`` on
  the CUDA EP at (2, 512) before timing, then timed with IOBinding
  (``stofc.package.bench.time_session``);
- ORT optimized: the same export through ``onnxruntime.transformers.optimizer``
  (``stofc.package.bench.optimized_baseline``: model type ``bert``, or ``gpt2`` for a
  causal graph), fp16, CUDA EP, IOBinding. A structured mask can only reach it as a
  dense bias, so its time is the dense-attention cost whatever the mask (timed once
  per model and shape);
- torch.compile + FlexAttention: the model's mirror (BERT: the anchors' post-LN
  encoder; GPT-2: a pre-LN block stack with tanh-GELU) with a block mask built from
  the package's own dense mask, so both compute the same masking.

CUDA-graph rows, same run: stofc and ORT optimized with provider option
``enable_cuda_graph=1`` (one session per shape; inputs and outputs bound once at
fixed device addresses; ORT's refusal message recorded if it refuses), each graph
output checked against the plain session's; torch.compile(mode="reduce-overhead").

Timing: the ORT sessions (stofc's and ORT's) are timed as ``stofc bench`` does
(``perf_counter`` around ``run_with_iobinding``, which returns after ORT synchronised);
torch.compile with ``triton.testing.do_bench`` (CUDA events). The mirrors have no
embeddings and no padding (a gather and an add, noise at these sizes); the ORT feeds
are right-padded as in ``stofc verify``. Which ops ORT's optimizer fused is recorded
(``baseline_ops``): on a transformers 5.x GPT-2 eager export it fused no attention
(checked on CPU), so GPT-2's ORT figure is unfused attention.

Order: the plain rows of every model first (export, ORT, then per mask: package, verify,
stofc, Flex), then the CUDA-graph rows of every model, so the main table is complete
before any graph capture is tried (a capture that crashes the process costs only those).

Median ms. Rows are appended to ``e2e.jsonl`` as they come and ``e2e-table.md`` is
rewritten after each, so a run cut short still leaves its tables. A deadline guard
skips (and records) what no longer fits.

Usage (device; ORT with the CUDA EP on PYTHONPATH, or ``--ort-site DIR``):
    python3 bench/e2e.py --out $OUT [--models bert,gpt2] [--masks bigbird,longformer,causal]
        [--cases "1:128 8:512 4:2048"] [--parts plain,graph] [--deadline 510]
Env defaults: E2E_MODELS, E2E_MASKS, E2E_CASES, E2E_PARTS, E2E_DEADLINE_S, STOFC_ORT_SITE.
Tables from the JSONL of several calls: python3 bench/e2e.py --table-from A.jsonl B.jsonl --out DIR
Self-check without a GPU: python3 bench/e2e.py --selftest [--work DIR with compiled packages]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_models import PROVIDERS, Recorder, environment, one_line, parse_cases, rel_error
from e2e_tables import selftest, write_tables

MASKS = {
    "bigbird": "bigbird:block=64,window=3,global=2,random=3,seed=0",
    "longformer": "longformer:window=128,global=32",
    "causal": "causal",
}
CASES = ((1, 128), (8, 512), (4, 2048))
VERIFY_CASE = (2, 512)
# Seconds a step may take on an H100/H200 (first compiles included); the guard skips a
# step when less than this is left. From the 2026-11-22 H200 run plus a margin.
COST = {"export": 60, "baseline": 50, "ort": 5, "ort_graph": 15, "package": 60, "stofc": 5,
        "stofc_graph": 12, "flex": 30, "flex_graph": 40}


def arguments(argv=None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=env("OUT", "bench/results"))
    p.add_argument("--work", default="/tmp/stofc-e2e")
    p.add_argument("--models", default=env("E2E_MODELS", "bert,gpt2"))
    p.add_argument("--masks", default=env("E2E_MASKS", ",".join(MASKS)))
    p.add_argument("--cases", default=env("E2E_CASES", " ".join(f"{b}:{s}" for b, s in CASES)))
    p.add_argument("--parts", default=env("E2E_PARTS", "plain,graph"),
                   help="plain (stofc/ORT/Flex), graph (CUDA graphs / reduce-overhead)")
    p.add_argument("--deadline", type=float, default=float(env("E2E_DEADLINE_S", "510")),
                   help="seconds from start after which nothing new starts")
    p.add_argument("--ort-site", default=env("STOFC_ORT_SITE"),
                   help="directory holding an onnxruntime with the CUDA EP (put first on sys.path)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--table-from", nargs="+", default=None, metavar="JSONL")
    p.add_argument("--selftest", action="store_true")
    return p.parse_args(argv)


@dataclass
class ModelRun:
    """What the plain phase of one model leaves for the graph phase."""

    case: object
    work: Path
    feeds: dict = field(default_factory=dict)      # (B, S) -> ORT feeds
    real: dict = field(default_factory=dict)       # (B, S) -> [B, S] bool, real tokens
    outputs: dict = field(default_factory=dict)    # ("ort", B, S) / ("stofc", mask, B, S)
    packages: dict = field(default_factory=dict)   # mask -> (package dir, dense mask)
    mirror: object = None                          # the torch.compile mirror, made once


def run_plain(case, args, rec: Recorder) -> ModelRun | None:
    """Export, ORT optimized, then per mask: package, verify, stofc and Flex (plain)."""
    import onnxruntime as ort
    from e2e_models import fused_ops

    from stofc.frontend import load_model
    from stofc.package.bench import optimized_baseline, time_session
    from stofc.package.verify import make_inputs

    m = case.name
    work = Path(args.work) / m
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"{m}.onnx"
    if not (work / "export.done").exists():
        if not rec.fits("export", model=m):
            return None
        start = time.time()
        case.export(src)
        (work / "export.done").write_text("ok")
        rec.emit(kind="step", step="export", model=m, s=round(time.time() - start, 1))
    graph = load_model(src)
    run = ModelRun(case, work)
    for b, s in parse_cases(args.cases):
        run.feeds[(b, s)], run.real[(b, s)] = make_inputs(graph, b, s,
                                                          np.random.default_rng(b * 7919 + s))
    if not rec.fits("baseline", model=m):
        return None
    base_path = work / "baseline.onnx"
    if not (work / "baseline.done").exists():
        start = time.time()
        optimized_baseline(graph, src, work)
        (work / "baseline.done").write_text("ok")
        rec.emit(kind="step", step="baseline", model=m, s=round(time.time() - start, 1))
    rec.emit(kind="step", step="baseline_ops", model=m,
             model_type="gpt2" if graph.layers[0].attention.causal_in_graph else "bert",
             expected_model_type=case.ort_model_type, ops=fused_ops(base_path))
    base = ort.InferenceSession(str(base_path), providers=PROVIDERS)
    for (b, s), feeds in run.feeds.items():
        if not rec.fits("ort", model=m, impl="ort", B=b, S=s):
            continue
        med, p10, p90 = time_session(base, feeds, warmup=args.warmup, repeat=args.repeat)
        out = run.outputs[("ort", b, s)] = base.run(None, feeds)[0]
        rec.emit(kind="time", model=m, mask=None, impl="ort", graph=False, B=b, S=s, ms=med,
                 p10=p10, p90=p90, finite=bool(np.isfinite(out[run.real[(b, s)]]).all()))
    base = None
    gc.collect()
    for mask in args.masks.split(","):
        if not rec.fits("package", model=m, mask=mask):
            continue
        try:
            plain_mask(run, mask, src, args, rec)
        except Exception as err:  # one mask failing leaves the others' rows
            rec.emit(kind="error", step="mask", model=m, mask=mask, err=one_line(err, 1500))
    return run


def plain_mask(run: ModelRun, mask: str, src: Path, args, rec: Recorder) -> None:
    """One mask of one model: package (compiled once), verify, stofc and Flex rows."""
    from e2e_models import package_dense_mask

    from stofc.package.bench import time_session
    from stofc.package.load import load
    from stofc.package.verify import verify_package
    from stofc.pipeline import Instruments, compile_model

    m = run.case.name
    pkg = run.work / f"pkg-{mask}"
    start = time.time()
    if not (pkg / "manifest.json").exists():  # compile_model writes atomically
        compile_model(src, MASKS[mask], gpu="auto", max_seq_len=2048, out_dir=pkg,
                      instruments=Instruments(progress=False))
    compile_s = round(time.time() - start, 1)
    report = verify_package(pkg, model=src, provider="cuda", cases=[VERIFY_CASE])
    rec.emit(kind="verify", model=m, mask=mask, passed=report.passed, rel=report.worst.rel,
             mask_effect=report.worst.mask_effect, compile_s=compile_s,
             verify_s=round(time.time() - start - compile_s, 1), report=report.to_dict())
    dense = package_dense_mask(pkg)
    run.packages[mask] = (pkg, dense)
    rec.emit(kind="step", step="mask", model=m, mask=mask, density_2048=float(dense.mean()),
             causal_subset=bool(not np.triu(dense, 1).any()))
    session = load(pkg, providers=PROVIDERS)
    for (b, s), feeds in run.feeds.items():
        if not rec.fits("stofc", model=m, mask=mask, impl="stofc", B=b, S=s):
            continue
        try:
            med, p10, p90 = time_session(session, feeds, warmup=args.warmup, repeat=args.repeat)
            out = run.outputs[("stofc", mask, b, s)] = session.run(None, feeds)[0]
            rec.emit(kind="time", model=m, mask=mask, impl="stofc", graph=False, B=b, S=s,
                     ms=med, p10=p10, p90=p90,
                     finite=bool(np.isfinite(out[run.real[(b, s)]]).all()))
        except Exception as err:  # report and go on: the other figures still count
            rec.emit(kind="error", model=m, mask=mask, impl="stofc", B=b, S=s, err=one_line(err))
    session = None
    gc.collect()
    if "plain" in args.parts.split(","):
        for b, s in run.feeds:
            flex_row(run, mask, b, s, False, rec)


def run_graph(run: ModelRun, args, rec: Recorder) -> None:
    """CUDA-graph rows of one model: ORT and stofc with enable_cuda_graph, Flex reduce-overhead."""
    import onnxruntime as ort

    from stofc.package.bench import graph_providers
    from stofc.package.load import load

    m = run.case.name
    base_path = run.work / "baseline.onnx"
    for (b, s), feeds in run.feeds.items():
        if ("ort", b, s) in run.outputs and rec.fits("ort_graph", model=m, impl="ort", B=b, S=s,
                                                      graph=True):
            timed_graph(rec, m, None, "ort", b, s, lambda: ort.InferenceSession(
                str(base_path), providers=graph_providers()), feeds, run.outputs[("ort", b, s)],
                run.real[(b, s)], args)
    for mask, (pkg, _) in run.packages.items():
        for (b, s), feeds in run.feeds.items():
            if ("stofc", mask, b, s) in run.outputs and rec.fits(
                    "stofc_graph", model=m, mask=mask, impl="stofc", B=b, S=s, graph=True):
                timed_graph(rec, m, mask, "stofc", b, s,
                            lambda p=pkg: load(p, providers=graph_providers()), feeds,
                            run.outputs[("stofc", mask, b, s)], run.real[(b, s)], args)
            flex_row(run, mask, b, s, True, rec)


def flex_row(run: ModelRun, mask: str, b: int, s: int, graphed: bool, rec: Recorder) -> None:
    """torch.compile(mirror) + FlexAttention on the package's mask at (b, s)."""
    from e2e_models import mirror, time_flex

    m = run.case.name
    if not rec.fits("flex_graph" if graphed else "flex", model=m, mask=mask, impl="flex", B=b,
                    S=s, graph=graphed):
        return
    try:
        if run.mirror is None:
            run.mirror = mirror(m)
        ms, c_s, skips = time_flex(run.mirror, run.packages[mask][1], b, s,
                                   mode="reduce-overhead" if graphed else None)
        rec.emit(kind="time", model=m, mask=mask, impl="flex", graph=graphed, B=b, S=s, ms=ms,
                 compile_s=round(c_s, 1), cudagraph_skips=skips)
    except Exception as err:  # report and go on
        rec.emit(kind="error", model=m, mask=mask, impl="flex", graph=graphed, B=b, S=s,
                 err=one_line(err))


def timed_graph(rec: Recorder, m: str, mask: str | None, impl: str, b: int, s: int, open_session,
                feeds, plain_out: np.ndarray, real: np.ndarray, args) -> None:
    """One CUDA-graph row: a fresh session for this shape, timed, checked against plain."""
    from stofc.package.bench import time_graph

    try:
        session = open_session()
        med, p10, p90, outs = time_graph(session, feeds, {"last_hidden_state": plain_out.shape},
                                         warmup=args.warmup, repeat=args.repeat)
        rec.emit(kind="time", model=m, mask=mask, impl=impl, graph=True, B=b, S=s, ms=med,
                 p10=p10, p90=p90, vs_plain_rel=rel_error(outs["last_hidden_state"], plain_out,
                                                          real))
    except Exception as err:  # ORT refuses capture with its own exception types
        rec.emit(kind="refused", model=m, mask=mask, impl=impl, graph=True, B=b, S=s,
                 err=one_line(err))
    finally:
        session = None
        gc.collect()


def main(argv=None) -> None:
    args = arguments(argv)
    if args.ort_site:
        sys.path.insert(0, args.ort_site)
    out = Path(args.out)
    if args.table_from:
        rows = [json.loads(line) for f in args.table_from for line in Path(f).read_text().splitlines()
                if line.strip()]
        print(write_tables(rows, out))
        return
    if args.selftest:
        selftest(Path(args.work))
        return
    from e2e_models import MODELS

    rec = Recorder(out, args.deadline, COST, jsonl="e2e.jsonl", tables=write_tables)
    env = rec.emit(**environment())
    if "CUDAExecutionProvider" not in env["providers"]:
        rec.emit(kind="error", err="this onnxruntime has no CUDAExecutionProvider; "
                 "pass --ort-site DIR (or STOFC_ORT_SITE) with onnxruntime-gpu")
        sys.exit(2)
    runs = []
    for name in args.models.split(","):  # the main table of every model first
        try:
            runs.append(run_plain(MODELS[name], args, rec))
        except Exception as err:  # one model failing leaves the other's rows
            rec.emit(kind="error", step="plain", model=name, err=one_line(err, 1500))
    if "graph" in args.parts.split(","):  # then CUDA graphs: a capture crash costs only these
        for run in filter(None, runs):
            try:
                run_graph(run, args, rec)
            except Exception as err:  # one model failing leaves the other's rows
                rec.emit(kind="error", step="graph", model=run.case.name, err=one_line(err, 1500))
    rec.emit(kind="done", left_s=round(rec.left(), 1))
    print(write_tables(rec.rows, out))


if __name__ == "__main__":
    main()
