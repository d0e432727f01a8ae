"""Where the end-to-end time goes: stofc package vs ORT's optimized model, one device call.

For each (B, L): the median wall time of ``run_with_iobinding`` (as ``stofc bench``),
then a kernel-level breakdown taken with ``torch.profiler`` (CUPTI records every
kernel of the process, ORT's included): per kernel name, the GPU microseconds per
run, and the GPU busy time against the wall time (the rest is host overhead or
gaps between launches). Then the same sessions with ORT's CUDA graph
(``enable_cuda_graph``), when ORT accepts the graph for capture. Also ORT's own
per-node profile (host-side time per op type) for the package at the smallest shape.

Usage (device, onnxruntime-gpu on PYTHONPATH): python3 bench/profile_e2e.py --out DIR
Env: PROFILE_MODEL (bert or gpt2, default bert), PROFILE_MASK (default bigbird),
PROFILE_CASES ("1:128 8:512 4:2048").
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


ATTENTION = re.compile(r"attn|attention|flash|fmha|flex|softmax|mha|sdpa|key_prep", re.I)
GEMM = re.compile(r"gemm|xmma|nvjet|cublas|cutlass|matmul|wgmma|(^|_)mm(_|$)|addmm|bmm|sm\d\d_",
                  re.I)


def classify(name: str) -> str:
    """'attention', 'gemm' or 'other' for a kernel name (attention patterns first: fused
    attention kernels often also contain GEMM words)."""
    if ATTENTION.search(name):
        return "attention"
    return "gemm" if GEMM.search(name) else "other"


ENTRY = re.compile(r'extern "C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')


LIBRARY_KERNELS = Path(__file__).resolve().parents[1] / "cuda" / "ort"


def package_entries(package: Path) -> set[str]:
    """The kernel entry points a stofc package can launch: its ``kernels/*.cu`` and those the
    custom-op library embeds (``cuda/ort/*.cu``, e.g. ``stofc_key_prep``)."""
    sources = [*sorted(Path(package, "kernels").glob("*.cu")), *sorted(LIBRARY_KERNELS.glob("*.cu"))]
    return {name for cu in sources for name in ENTRY.findall(cu.read_text())}


def foreign_kernels(names, entries: set[str], width: int = 90) -> list[str]:
    """The ``stofc_`` kernel names a profile of one package's session recorded that the
    package does not define (names compared at the profile's ``width`` characters).

    CUPTI can report a kernel under the name of a function another package loaded earlier in
    the same process (seen on an H200, 2026-11-27: the causal package's FFN GEMM recorded as
    the BigBird package's ``..._combine``); a row with such names has an unreliable split."""
    own = {e[:width] for e in entries}
    return sorted({n for n in names if n.startswith("stofc_") and n[:width] not in own})


GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def timeline(events: list[dict], runs: int, top: int = 8, head_n: int = 16) -> dict:
    """Where a run's wall time goes between GPU activities, from a chrome trace's events.

    Contract: ``events`` are torch.profiler chrome-trace events of ``runs`` identical runs
    on one stream; GPU activities (``GPU_CATS``) link to their launch call (``LAUNCH_CATS``)
    through ``args.correlation``. Each gap between two consecutive activities of a run is
    ``host`` when the next one's launch call ended after the previous activity ended (the GPU
    waited for the host) and ``device`` otherwise (the launch was queued: the gap is the
    GPU's own turnaround). Returns, per run in ms: ``span`` (first start to last end),
    ``idle`` (span minus busy), ``host_gap`` and ``device_gap`` (idle split that way),
    ``lead`` (first launch call to first activity: host work before the GPU starts), the
    gap count, the ``top`` (previous, next) name pairs by idle time per run, and ``head``:
    the first ``head_n`` activities of the first run (name, gap before it, and
    ``queued``: how long before it started its launch call had ended, negative if after).
    """
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS and "dur" in e),
                 key=lambda e: e["ts"])
    launch = {e["args"]["correlation"]: e for e in events
              if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    if not gpu or len(gpu) % runs:
        return {"error": f"{len(gpu)} GPU activities for {runs} runs"}
    per = len(gpu) // runs

    def call_end(act: dict) -> float | None:
        call = launch.get(act.get("args", {}).get("correlation"))
        return None if call is None else call["ts"] + call.get("dur", 0)

    head = []
    for i, act in enumerate(gpu[:min(head_n, per)]):
        gap = act["ts"] - (gpu[i - 1]["ts"] + gpu[i - 1]["dur"]) if i else 0.0
        done = call_end(act)
        head.append(dict(name=act["name"][:60], gap_us=round(gap, 1),
                         queued_us=None if done is None else round(act["ts"] - done, 1)))
    totals = collections.Counter()
    pairs: dict[tuple[str, str], float] = collections.defaultdict(float)
    for r in range(runs):
        chunk = gpu[r * per:(r + 1) * per]
        first_call = launch.get(chunk[0].get("args", {}).get("correlation"))
        if first_call is not None:
            totals["lead"] += chunk[0]["ts"] - first_call["ts"]
        totals["span"] += chunk[-1]["ts"] + chunk[-1]["dur"] - chunk[0]["ts"]
        end = chunk[0]["ts"] + chunk[0]["dur"]
        for prev, nxt in itertools.pairwise(chunk):
            gap = nxt["ts"] - end
            end = max(end, nxt["ts"] + nxt["dur"])
            if gap <= 0:
                continue
            done = call_end(nxt)
            host = done is not None and done > prev["ts"] + prev["dur"]
            totals["host_gap" if host else "device_gap"] += gap
            totals["gaps"] += 1
            pairs[(prev["name"][:60], nxt["name"][:60])] += gap
    out = {k: round(totals[k] / runs / 1e3, 4) for k in ("span", "host_gap", "device_gap", "lead")}
    out["idle"] = round(out["host_gap"] + out["device_gap"], 4)
    out["gaps"] = round(totals["gaps"] / runs, 1)
    out["top"] = [dict(prev=a, next=b, us=round(v / runs, 1))
                  for (a, b), v in sorted(pairs.items(), key=lambda kv: -kv[1])[:top]]
    out["head"] = head
    return out


def union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of the intervals ``spans`` ((start, end) pairs, any order)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def class_union_us(spans: list[tuple[str, float, float]]) -> dict[str, float]:
    """GPU time of each kernel class (:func:`classify`) as the union of its kernels'
    (name, start, end) intervals: kernels of one class that overlap (a kernel launched by
    programmatic dependent launch while its predecessor runs, waiting for it) count once.
    Classes that overlap each other (a GEMM started before an attention kernel ends) are each
    charged the shared time, so the classes can sum to more than the busy time."""
    by_kind: dict[str, list[tuple[float, float]]] = {"attention": [], "gemm": [], "other": []}
    for name, s, e in spans:
        by_kind[classify(name)].append((s, e))
    return {kind: union_us(iv) for kind, iv in by_kind.items()}


def kernel_breakdown(run, runs: int = 5) -> dict:
    """GPU time per kernel name per run, busy time and wall time of ``runs`` calls, and
    ``split_ms``: the GPU time per run of attention, GEMM and other kernels (:func:`classify`),
    each the union of its kernels' intervals (:func:`class_union_us`). ``top``'s per-name
    figures are the kernels' own durations: a kernel launched early by programmatic dependent
    launch (the ws attention's combine) counts the time it waited for its predecessor there,
    not in ``split_ms``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(runs):
            run()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / runs
    per: dict[str, float] = collections.defaultdict(float)
    count: dict[str, float] = collections.defaultdict(float)
    spans = []
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        dur = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        per[ev.name[:90]] += dur / runs
        count[ev.name[:90]] += 1 / runs
        spans.append((ev.name, ev.time_range.start, ev.time_range.end))
    busy = union_us([(s, e) for _, s, e in spans])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            gaps = timeline(json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"], runs)
    except Exception as err:  # the split above stands without the timeline
        gaps = {"error": str(err)[:200]}
    top = [dict(name=n, us=round(v, 1), n=round(count[n], 1), kind=classify(n))
           for n, v in sorted(per.items(), key=lambda kv: -kv[1])[:25]]
    split = {kind: us / runs / 1e3 for kind, us in class_union_us(spans).items()}
    return dict(wall_ms=round(wall, 3), gpu_busy_ms=round(busy / runs / 1e3, 3),
                kernels_per_run=round(sum(count.values()), 1),
                gpu_sum_ms=round(sum(per.values()) / 1e3, 3), top=top, timeline=gaps,
                names=sorted(per),
                split_ms={k: round(v, 3) for k, v in split.items()})


def main() -> None:
    import e2e
    import e2e_models
    import onnxruntime as ort

    from stofc.frontend import load_model
    from stofc.package.bench import device_binding, optimized_baseline, time_session
    from stofc.package.load import load
    from stofc.package.verify import make_inputs
    from stofc.pipeline import Instruments, compile_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    parser.add_argument("--work", default="/tmp/stofc-prof")
    args = parser.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    mask = os.environ.get("PROFILE_MASK", "bigbird")
    cases = [tuple(int(x) for x in c.split(":"))
             for c in os.environ.get("PROFILE_CASES", "1:128 8:512 4:2048").split()]
    model = os.environ.get("PROFILE_MODEL", "bert")
    result: dict = {"model": model, "mask": mask, "cases": {}}

    def dump():
        (out / "profile-e2e.json").write_text(json.dumps(result, indent=1))

    src = work / f"{model}.onnx"
    if not src.exists():
        {"bert": e2e_models.export_bert, "gpt2": e2e_models.export_gpt2}[model](src)
    graph = load_model(src)
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    pkg = compile_model(src, e2e.MASKS[mask], gpu="auto", max_seq_len=2048,
                        out_dir=work / f"pkg-{model}-{mask}", instruments=Instruments(progress=False))
    base_path = optimized_baseline(graph, src, work)
    sessions = {"stofc": load(pkg, providers=providers),
                "ort": ort.InferenceSession(str(base_path), providers=providers)}
    rng = np.random.default_rng(0)
    for b, s in cases:
        feeds, _ = make_inputs(graph, b, s, rng)
        row: dict = {}
        for name, sess in sessions.items():
            med, p10, p90 = time_session(sess, feeds, warmup=10, repeat=50)
            binding = device_binding(sess, feeds)
            sess.run_with_iobinding(binding)
            row[name] = dict(median_ms=round(med, 3), p10=round(p10, 3), p90=round(p90, 3),
                             profile=kernel_breakdown(lambda s_=sess, b_=binding: s_.run_with_iobinding(b_)))
            print(b, s, name, json.dumps({k: v for k, v in row[name].items()})[:3000], flush=True)
        result["cases"][f"{b}x{s}"] = row
        dump()
    # CUDA graphs: one session per shape (ORT captures a fixed shape).
    graph_rows: dict[str, dict] = {}
    for b, s in cases:
        feeds, _ = make_inputs(graph, b, s, rng)
        for name in ("stofc", "ort"):
            opts = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"]
            try:
                if name == "stofc":
                    sess = load(pkg, providers=opts)
                else:
                    sess = ort.InferenceSession(str(base_path), providers=opts)
                med, p10, p90 = time_session(sess, feeds, warmup=10, repeat=50)
                graph_rows[f"{name}-graph-{b}x{s}"] = dict(median_ms=round(med, 3), p10=round(p10, 3),
                                                           p90=round(p90, 3))
            except Exception as err:  # record why ORT refused
                graph_rows[f"{name}-graph-{b}x{s}"] = dict(err=str(err).strip()[:600])
            print(name, "graph", b, s, graph_rows[f"{name}-graph-{b}x{s}"], flush=True)
    result["cuda_graph"] = graph_rows
    dump()
    # ORT's per-node host profile of the package at the first shape (IOBinding, as timed).
    b, s = cases[0]
    feeds, _ = make_inputs(graph, b, s, rng)
    sess = load(pkg, providers=providers, session_options_hook=lambda so: setattr(
        so, "enable_profiling", True))
    binding = device_binding(sess, feeds)
    for _ in range(20):
        sess.run_with_iobinding(binding)
    trace = json.loads(Path(sess.end_profiling()).read_text())
    per_op = collections.defaultdict(list)
    for ev in trace:
        if ev.get("cat") == "Node" and ev["name"].endswith("_kernel_time"):
            per_op[ev["args"].get("op_name", "?")].append(ev["dur"])
    result["ort_node_profile_us"] = {k: dict(n=len(v) / 20, median=float(np.median(v)),
                                             total_per_run=float(sum(v)) / 20)
                                     for k, v in per_op.items()}
    result["ort_last_run_us"] = last_run_nodes(trace)
    print(json.dumps(result["ort_node_profile_us"], indent=1))
    print(json.dumps(result["ort_last_run_us"], indent=1))
    dump()


def last_run_nodes(trace: list[dict], first: int = 16) -> dict:
    """ORT's host timeline of the profile's last run: its wall span, the host time inside
    node kernels and between them, and its first ``first`` nodes (name, op, start from the
    run's start and duration, microseconds)."""
    runs = [ev for ev in trace if ev.get("cat") == "Session" and ev.get("name") == "model_run"]
    if not runs:
        return {}
    run = max(runs, key=lambda ev: ev["ts"])
    nodes = sorted((ev for ev in trace if ev.get("cat") == "Node"
                    and ev["name"].endswith("_kernel_time")
                    and run["ts"] <= ev["ts"] <= run["ts"] + run["dur"]), key=lambda ev: ev["ts"])
    inside = sum(ev["dur"] for ev in nodes)
    return dict(run_us=run["dur"], in_nodes_us=inside, outside_nodes_us=run["dur"] - inside,
                nodes=len(nodes),
                first=[dict(name=ev["name"][:-len("_kernel_time")][-40:],
                            op=ev["args"].get("op_name", "?"), at=ev["ts"] - run["ts"],
                            dur=ev["dur"]) for ev in nodes[:first]])


if __name__ == "__main__":
    main()
