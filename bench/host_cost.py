"""Host cost per call of a stofc package in ONNX Runtime (issue 18, short inputs), on the GPU.

A BERT-base-shaped encoder (``examples/build_model.py``: 12 layers, hidden 768, 12
heads, FFN 3072, 512 positions, random weights) is compiled for the GPU present and
run at (B, L) = (1, 128) by default with IOBinding (inputs on ``cuda:0`` once, outputs
bound on the device), on a CUDA stream this script owns (the CUDA EP's
``user_compute_stream``), so CUDA events can be recorded around each run on the very
stream ORT launches on. Per side, ``repeat`` runs after ``warmup``, medians:

- ``wall_ms``: ``perf_counter`` around ``run_with_iobinding`` (ORT synchronises its
  stream before returning): what a caller waits for;
- ``enqueue_ms``: the same call with the run option
  ``disable_synchronize_execution_providers=1``, so it returns once every kernel is
  enqueued (the stream is synchronised outside the timed region): the host's work per
  call, custom ops included;
- ``gpu_ms``: CUDA events recorded on the stream before and after the run: the GPU's
  span for the run (host gaps between launches included when the host is the bottleneck);
- ``host_bound_ms`` = ``wall_ms - gpu_ms`` (what the wait exceeds the GPU span by) and
  ``enqueue_us_per_node`` = ``enqueue_ms`` / nodes of the session's model.

Sides: ``stofc`` (the package), ``ort-optimized`` (the same model through ORT's
transformer optimizer, fp16: ``stofc.package.bench.optimized_baseline``) and, with
``--cuda-graph``, ``stofc-graph`` (``stofc.load(pkg, cuda_graph=True)``, replays timed
by ``stofc.package.bench.time_graph``; its wall time only).

Run on the GPU machine (README "Running on a GPU"; onnxruntime-gpu via
bench/ort_env.sh, CuPy present)::

    PYTHONPATH=. python bench/host_cost.py --json-out bench/results/host-cost.json

Prints one line per side and writes the JSON when asked. Nothing here is a GPU claim
until it has been run there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"


def _bind(session, feeds):
    import onnxruntime as ort

    io = session.io_binding()
    keep = [ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for v in feeds.values()]
    for name, value in zip(feeds, keep, strict=True):
        io.bind_ortvalue_input(name, value)
    for out in session.get_outputs():
        io.bind_output(out.name, "cuda")
    io.synchronize_inputs()
    return io, keep


def time_side(session, feeds, stream, nodes: int, *, warmup: int, repeat: int) -> dict:
    """wall, enqueue and GPU medians (module doc) of ``session`` (a model of ``nodes``
    nodes) on ``stream``."""
    import cupy
    import onnxruntime as ort

    io, _keep = _bind(session, feeds)
    nosync = ort.RunOptions()
    nosync.add_run_config_entry("disable_synchronize_execution_providers", "1")
    for _ in range(warmup):
        session.run_with_iobinding(io)
    wall, enqueue, gpu = [], [], []
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(repeat):
        t = time.perf_counter()
        session.run_with_iobinding(io)
        wall.append((time.perf_counter() - t) * 1e3)
    for _ in range(repeat):
        stream.synchronize()
        start.record(stream)
        t = time.perf_counter()
        session.run_with_iobinding(io, nosync)
        enqueue.append((time.perf_counter() - t) * 1e3)
        end.record(stream)
        end.synchronize()
        gpu.append(cupy.cuda.get_elapsed_time(start, end))
    w, e, g = (statistics.median(x) for x in (wall, enqueue, gpu))
    return {"wall_ms": w, "enqueue_ms": e, "gpu_ms": g, "host_bound_ms": w - g,
            "nodes": nodes, "enqueue_us_per_node": e * 1e3 / nodes if nodes else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--mask", default="bigbird:block=64,window=3,global=2,random=3,seed=0")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--cuda-graph", action="store_true")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()

    import cupy
    import onnxruntime as ort
    from build_model import build_model

    from stofc.frontend import load_model
    from stofc.package.bench import optimized_baseline, time_graph
    from stofc.package.load import load
    from stofc.package.verify import make_inputs
    from stofc.pipeline import Instruments, compile_model
    from stofc.targets import detect

    if CUDA not in ort.get_available_providers():
        print("error: onnxruntime has no CUDAExecutionProvider; source bench/ort_env.sh")
        return 2
    stream = cupy.cuda.Stream(non_blocking=True)
    cuda = (CUDA, {"user_compute_stream": str(stream.ptr), "has_user_compute_stream": "1"})
    results: dict = {"batch": args.batch, "seq_len": args.seq_len, "layers": args.layers,
                     "mask": args.mask, "onnxruntime": ort.__version__, "sides": {}}
    with tempfile.TemporaryDirectory(prefix="stofc-hostcost-") as tmp:
        work = Path(tmp)
        model = work / "model.onnx"
        onnx.save(build_model(layers=args.layers, hidden=768, heads=12, ffn=3072, seq=512),
                  str(model))
        gpu = detect()
        results["gpu"] = gpu.name
        pkg = compile_model(model, args.mask, gpu=gpu.name, max_seq_len=512,
                            out_dir=work / "pkg", instruments=Instruments(progress=False))
        graph = load_model(model)
        feeds, _ = make_inputs(graph, args.batch, args.seq_len, np.random.default_rng(0))
        sides = {"stofc": (lambda: load(pkg, providers=[cuda, CPU]), pkg / "model.onnx")}
        base = optimized_baseline(graph, model, work)
        sides["ort-optimized"] = (lambda: ort.InferenceSession(str(base), providers=[cuda, CPU]),
                                  base)
        for name, (open_session, path) in sides.items():
            session = open_session()
            nodes = len(onnx.load(str(path), load_external_data=False).graph.node)
            r = time_side(session, feeds, stream, nodes, warmup=args.warmup, repeat=args.repeat)
            results["sides"][name] = r
            print(f"{name:14s} wall {r['wall_ms']:.3f} ms  enqueue {r['enqueue_ms']:.3f} ms  "
                  f"gpu {r['gpu_ms']:.3f} ms  host-bound {r['host_bound_ms']:+.3f} ms  "
                  f"{r['nodes']} nodes, {r['enqueue_us_per_node']:.1f} us/node enqueued")
            del session
        if args.cuda_graph:
            plain = load(pkg, providers=[CUDA, CPU])
            outs = {o.name: v.shape for o, v in zip(plain.get_outputs(), plain.run(None, feeds),
                                                    strict=True)}
            try:
                med, p10, p90, _ = time_graph(load(pkg, cuda_graph=True), feeds, outs,
                                              warmup=args.warmup, repeat=args.repeat)
                results["sides"]["stofc-graph"] = {"wall_ms": med, "p10_ms": p10, "p90_ms": p90}
                print(f"{'stofc-graph':14s} wall {med:.3f} ms (p10 {p10:.3f}, p90 {p90:.3f})")
            except Exception as err:  # a refusal is a result too
                results["sides"]["stofc-graph"] = {"error": str(err).splitlines()[0]}
                print(f"stofc-graph    refused: {str(err).splitlines()[0]}")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
