"""Long-context end to end on the GPU, one process: stofc packages vs ORT vs torch.compile.

Models (``bench/e2e_long_models.py``): BERT-base with 32768 positions (Longformer w256 g16,
BigBird b64 w3 g2 r3, causal), ModernBERT-base shapes (its own local/global mask), a
Llama-style GQA decoder in fp16 (its own causal mask, and a 4096 window ANDed in). Each is
exported on the device (random weights, seed 0; TorchScript, opset 17).

Per model, mask and (B, L), in one process:

- stofc: ``compile_model`` (max_seq_len = the model's longest point), ``verify_package``
  on the CUDA EP at (2, 512) before timing; timed with IOBinding, a fresh session per
  shape; its peak device memory (``cudaMemGetInfo`` after the timed runs minus before the
  session; arenas grow by what is asked);
- ORT optimized: ``optimized_baseline`` (ORT's transformer optimizer, fp16, CUDA EP), the
  same way; an out-of-memory or refusal is a row with ORT's reason;
- torch.compile of the same Hugging Face model (same weights) with FlexAttention on the
  package's own per-layer masks (``bench/e2e_torch.py``), and where the masks allow,
  SDPA (dense/causal) and FA4 (dense/causal/bands; only if ``/tmp/fa4site`` exists);
  peak memory ``torch.cuda.max_memory_allocated``; each output compared with the package's
  on the same tokens (``vs_stofc_rel``);
- CUDA graphs at the short points: stofc and ORT with ``enable_cuda_graph`` (one session
  per shape, outputs checked against the plain run's; refusals recorded), torch.compile
  ``mode="reduce-overhead"``; the short points are timed in 5 same-call rounds;
- check: at each model's longest point (BERT L=32768) the package against the same model
  in fp32 torch with FlexAttention and the package's masks, on the GPU (``verify_package``'s
  CPU reference cannot hold L x L scores at 32K);
- ``--profile``: GPU time per side split into attention, GEMMs and the rest (CUPTI via
  torch.profiler, ``bench/profile_e2e.py``) at ``--profile-cases``.

Order: every model's export first (its packages then compile in parallel processes,
``bench/e2e_long_build.py``, while ORT's optimizer runs), then per model its packages and
the target points (stofc and ORT at (1, 8192), (1, 16384) and the longest batch-1 length;
the short points in 5 same-call rounds), then across models: the fp32 check, Flex at the
targets, CUDA graphs, the other lengths, the other torch anchors, the profile. A
deadline guard (``--deadline`` seconds from start) skips and records what no longer fits;
a compile still running at the reserve (or after ``--compile-wait``) is killed and
recorded. Timing: median of adaptive runs (all that fit in ~3 s, at least 5, at most 50).
Rows go to ``$OUT/STEM.jsonl`` as they come; ``STEM.md`` (tables), ``STEM.json`` and
``STEM.png`` (speed-up and memory against length) are rewritten as they come; STEM =
``e2e-long-<gpu>-<date>[-TAG]``.

Device (H100; the ORT CUDA-EP wheel assembled at /tmp/ortgpu.whl first, README "Running
on a GPU"). Each model's defaults, one call each: ``--models bert32k`` (L_max 32768),
``--models llama``, ``--models modernbert``. What fits two calls of at most 9 minutes
(run tool timeout 540 s) with the product as it is on this branch's base:

    source bench/ort_env.sh; python3 bench/e2e_long.py --out $OUT --models bert32k --cases "1:8192 1:16384 1:128 8:512 1:4096 2:4096 2:8192" --tag bert16k --deadline 500
    source bench/ort_env.sh; python3 bench/e2e_long.py --out $OUT --models bert32k,llama --cases "1:32768 1:8192" --parts core,torch,check --tag long --deadline 500 --compile-wait 300

Expected (estimated from this branch's CPU-side measurements, not device timings; the
``step`` rows give the real ones). Call 1 ~8 min: BERT's packages for L_max 16384 (the
issue's targets are at 8K and 16K), export ~20 s, three compiles in parallel ~1.5 min
beside ORT's optimizer, verify ~15 s each, the target rows ~1 min, the short rounds ~40 s,
Flex at (1, 8192) and (1, 16384) ~1 min per compile, then CUDA graphs and the other points
as the deadline allows. Call 2 ~8.5 min: the 32K row and the Llama decoder. BERT's three
compiles at L_max 32768 take ~3-4 min (the frontend evaluates BERT's own [1, 1, S, S]
mask at S=32768: 12 s and 3.6 GB at 8192, 47 s and 7.3 GB at 16384 here, so ~2.5 min
and ~22 GB per compile), Llama's two ~2 min in parallel; then the fp32 check at 32K
(~1.5 min), the rows, Flex. ModernBERT needs a call of its own (``--models modernbert
--compile-wait 330``): at L_max 8192 kernel selection re-runs an O(L^2) permutation
search for each of its 14 local layers (17 s per layer here), so its compile takes
minutes (``--compile-wait`` kills and records it if it does not end in time).
A verify that cannot run (not a mismatch) is recorded and the package timed and left
to the check; a package that fails verify is never timed.
Merge the calls:
``python3 bench/e2e_long.py --table-from A.jsonl B.jsonl --out bench/results``.
``--profile`` (or ``--parts profile``) adds the kernel split. Without a GPU:
``--selftest`` (tables and plot from synthetic rows; with torch: toy exports and the
torch side's mask swap) and ``--rehearse`` (the whole flow on the CPU with toy models).
"""

from __future__ import annotations

import datetime
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_long_plan import BLOCKS, MODELS, PART_OF, REHEARSAL_VERIFY, Run, arguments
from e2e_long_sides import (
    check_point,
    ort_opener,
    ort_point,
    profile_point,
    short_point,
    stofc_opener,
    torch_point,
)
from e2e_long_tables import default_stem, write_tables
from e2e_models import Recorder, environment, one_line, parse_cases

# Seconds a step may take on an H100 (first compiles included); the guard skips a step
# when less is left. Estimates: replace with the step rows' ``s`` of a first run.
COST = {"export": 90, "baseline": 90, "package": 150, "ort": 20, "stofc": 12, "short": 60,
        "graph": 60, "torch": 75, "check": 100, "profile": 40, "after_compile": 120}
LIBRARY: dict = {}  # the custom-op library prewarm thread (e2e_long_build)
VERIFY_CASE = (2, 512)
ROUNDS = 5

# ---------------------------------------------------------------------------- stages

def stage_prep(run: Run, rec: Recorder) -> None:
    """Export (once per work dir), read the model's graph, start its package compiles."""
    from e2e_long_build import start_compiles
    from e2e_long_models import export, left_to_ort

    from stofc.frontend import load_model

    run.work.mkdir(parents=True, exist_ok=True)
    done = run.work / "export.json"
    if not done.exists():
        if not rec.fits("export", model=run.name):
            run.failed = "export skipped (deadline)"
            return
        start = time.time()
        info = export(run.name, run.src, small=run.small)
        done.write_text(json.dumps(info))
        rec.emit(kind="step", step="export", model=run.name, s=round(time.time() - start, 1),
                 **info)
    run.info = json.loads(done.read_text())
    if LIBRARY.get("thread") is not None:  # the compiles take the library from the cache
        LIBRARY.pop("thread").join()
    if rec.fits("package", model=run.name):
        run.compiles = start_compiles(run.src, run.masks, run.work, gpu=gpu_name(run),
                                      dtype=run.case.dtype, max_seq_len=run.max_seq_len)
    start = time.time()
    run.graph = load_model(run.src)
    rec.emit(kind="step", step="left_to_ort", model=run.name, left=left_to_ort(run.graph),
             s=round(time.time() - start, 1))


def gpu_name(run: Run) -> str:
    """The --gpu of the compiles: the GPU present (its profile name), h100 in a rehearsal."""
    from stofc.targets import get_profile

    return "h100" if run.small else get_profile("auto").name


def stage_packages(run: Run, rec: Recorder) -> None:
    """ORT's optimized model (while the packages compile), then each package verified on
    the CUDA EP and its per-layer masks read."""
    from e2e_long_build import package_dir, wait_compiles
    from e2e_long_models import layer_masks
    from e2e_models import fused_ops

    from stofc.package.bench import optimized_baseline
    from stofc.package.verify import verify_package

    baseline(run, rec, optimized_baseline, fused_ops)
    reserve, cap, start = COST["after_compile"], run.args.compile_wait, time.time()

    def left():  # the run's time left, or this model's compile budget
        return min(rec.left(), reserve + cap - (time.time() - start)) if cap else rec.left()

    for mask, (status, text) in wait_compiles(run.compiles, left, reserve).items():
        if status == "ok":
            rec.emit(kind="step", step="package", model=run.name, mask=mask, s=float(text))
        else:
            rec.emit(kind="error" if status == "error" else "skip", step="package",
                     model=run.name, mask=mask, **{"err" if status == "error" else "why": text})
    for mask in run.masks:
        pkg = package_dir(run.work, mask, run.max_seq_len)
        if not (pkg / "manifest.json").exists():
            continue
        start = time.time()
        try:
            report = verify_package(pkg, model=run.src, provider="cpu" if run.small else "cuda",
                                    cases=[REHEARSAL_VERIFY if run.small else VERIFY_CASE])
        except Exception as err:  # verify could not run (not a mismatch): time it anyway,
            # the check stage and the torch rows' vs_stofc_rel compare it at long lengths
            rec.emit(kind="error", step="verify", model=run.name, mask=mask,
                     err=one_line(err), note="timed unverified")
        else:
            rec.emit(kind="verify", model=run.name, mask=mask, passed=report.passed,
                     rel=report.worst.rel, bound=report.bound,
                     mask_effect=report.worst.mask_effect, s=round(time.time() - start, 1),
                     report=report.to_dict())
            if not report.passed:  # a package computing something else is never timed
                continue
        run.packages[mask] = pkg
        run.layer_masks[mask] = layer_masks(pkg)
        of_layer, dense, specs = run.layer_masks[mask]
        rec.emit(kind="step", step="mask", model=run.name, mask=mask,
                 groups=[{"layers": sorted(k for k, g in of_layer.items() if g == i),
                          "spec": specs[i], "density": round(float(d.mean()), 5)}
                         for i, d in enumerate(dense)])


def baseline(run: Run, rec: Recorder, optimized_baseline, fused_ops) -> None:
    """ORT's transformer-optimized fp16 model (once per work dir) and what it fused."""
    run.base = run.work / "baseline.onnx"
    if not (run.work / "baseline.done").exists():
        if not rec.fits("baseline", model=run.name):
            run.base = None
            return
        start = time.time()
        try:
            optimized_baseline(run.graph, run.src, run.work)
            (run.work / "baseline.done").write_text("ok")
        except Exception as err:  # ORT's optimizer failing is a result too
            rec.emit(kind="error", step="baseline", model=run.name, err=one_line(err, 1500))
            run.base = None
            return
        rec.emit(kind="step", step="baseline", model=run.name, s=round(time.time() - start, 1))
    causal = run.graph.layers[0].attention.causal_in_graph
    rec.emit(kind="step", step="baseline_ops", model=run.name,
             model_type="gpt2" if causal else "bert", expected=run.case.ort_model_type,
             ops=fused_ops(run.base))


def stage_core(run: Run, rec: Recorder, cases: list[tuple[int, int]]) -> None:
    """ORT then each package at ``cases`` (plain sessions)."""
    for b, s in cases:
        if run.base is not None:
            ort_point(run, rec, "ort", None, b, s, ort_opener(run))
        for mask in run.packages:
            ort_point(run, rec, "stofc", mask, b, s, stofc_opener(run, mask))


def stage_core_key(run: Run, rec: Recorder) -> None:
    stage_core(run, rec, run.key_cases())
    for b, s in run.cases(True):
        short_rounds(run, rec, b, s, graph=False)


def stage_core_rest(run: Run, rec: Recorder) -> None:
    key = set(run.key_cases())
    stage_core(run, rec, [c for c in run.cases(False) if c not in key])


def short_rounds(run: Run, rec: Recorder, b: int, s: int, graph: bool) -> None:
    """Every side at a short point, fresh sessions held together, timed in ROUNDS rounds."""
    if rec.fits("graph" if graph else "short", model=run.name, B=b, S=s, graph=graph):
        short_point(run, rec, b, s, graph, ROUNDS)


def stage_graph(run: Run, rec: Recorder) -> None:
    for b, s in run.cases(True):
        short_rounds(run, rec, b, s, graph=True)
        torch_point(run, rec, "flex", b, s, "reduce-overhead")


def stage_torch_key(run: Run, rec: Recorder) -> None:
    for b, s in [c for c in run.torch_cases() if c in run.key_cases()]:
        torch_point(run, rec, "flex", b, s, None)


def stage_torch_rest(run: Run, rec: Recorder) -> None:
    key = [c for c in run.torch_cases() if c in run.key_cases()]
    for b, s in [c for c in run.torch_cases() if c not in key]:
        torch_point(run, rec, "flex", b, s, None)
    for impl in ("fa4", "sdpa"):
        for b, s in key:
            torch_point(run, rec, impl, b, s, None)


def stage_check(run: Run, rec: Recorder) -> None:
    for b, s in run.check_cases():
        check_point(run, rec, b, s)


def stage_profile(run: Run, rec: Recorder) -> None:
    for b, s in parse_cases(run.args.profile_cases):
        if s <= run.max_seq_len:
            profile_point(run, rec, b, s)


def run_all(args, rec: Recorder) -> None:
    from e2e_long_build import prewarm_library

    LIBRARY["thread"] = prewarm_library()
    runs = []
    for name in args.models.split(","):
        case = MODELS[name]
        masks = {k: v for k, v in case.masks.items()
                 if not args.masks or k in args.masks.split(",")}
        runs.append(Run(case, Path(args.work) / name, args, masks=masks))
    for block in BLOCKS:  # a model's key rows right after its packages: a slow compile
        for run in runs:  # of the next model costs only that model's rows
            for stage in block:
                if stage not in ("prep", "packages") and not {stage, PART_OF[stage]} \
                        & args.part_set:
                    continue
                if run.failed or (stage != "prep" and run.graph is None):
                    continue
                try:
                    globals()[f"stage_{stage}"](run, rec)
                except Exception as err:  # one stage failing leaves the others' rows
                    rec.emit(kind="error", step=stage, model=run.name, err=one_line(err, 1500))
        gc.collect()


def main(argv=None) -> None:
    args = arguments(argv)
    if args.ort_site:
        sys.path.insert(0, args.ort_site)
    out = Path(args.out)
    if args.table_from:
        rows = [json.loads(line) for f in args.table_from
                for line in Path(f).read_text().splitlines() if line.strip()]
        print(write_tables(rows, out, default_stem(rows) + (f"-{args.tag}" if args.tag else "")))
        return
    if args.selftest:
        from e2e_long_selftest import selftest

        selftest()
        return
    env = environment()
    env["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    env["args"] = {k: v for k, v in vars(args).items() if k != "part_set"}
    stem = default_stem([env]) + (f"-{args.tag}" if args.tag else "")
    last_plot = [0.0]

    def tables(rows, o):  # the plot at most once a minute (a second each), and at the end
        draw = time.time() - last_plot[0] > 60
        last_plot[0] = time.time() if draw else last_plot[0]
        write_tables(rows, o, stem, draw=draw)

    rec = Recorder(out, args.deadline, COST, jsonl=f"{stem}.jsonl", tables=tables)
    rec.emit(**env)
    if args.rehearse:
        import e2e_long_sides

        e2e_long_sides.DEVICE["type"] = "cpu"
    elif "CUDAExecutionProvider" not in env["providers"]:
        rec.emit(kind="error", err="this onnxruntime has no CUDAExecutionProvider; "
                 "source bench/ort_env.sh (or pass --ort-site DIR)")
        sys.exit(2)
    run_all(args, rec)
    rec.emit(kind="done", left_s=round(rec.left(), 1))
    print(write_tables(rec.rows, out, stem))


if __name__ == "__main__":
    main()
