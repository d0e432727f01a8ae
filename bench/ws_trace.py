"""Where a warp-specialised launch's time goes, work by work (a development probe, issue 14).

For each case the selector's ws config is built as the product builds it (``ws_config``,
:class:`AttentionOp`), its template rendered a second time with ``trace_works`` > 0
(``block_ws.cu.j2``'s TRACE: clock64 stamps per block, warpgroup and work, in the module's
``<kernel>_trace`` array) and swapped into the op, so the walk and the launch are the
product's. One traced launch (after warm-up) is read back and summarised:

* the launch: span, blocks' start skew, when the blocks finish (median, p90, last);
* per consumer work (every block and warpgroup): cycles from the work's start to its Q,
  through its steps, through its epilogue, and the gap to the next work; cycles waiting for
  K and for ping-pong turns; cycles per step that computed;
* the producer: cycles waiting for free ring slots per work;
* per kind of work (``by_kind``: shared chunks, the rest) and, inside shared chunks, per kind
  of step (``step_kinds``: computed, the skipped step after a computed one, other skipped
  steps), from a second array of per-step stamps (``<kernel>_steps``);
* the block that finished last, work by work.

The untraced kernel is timed in the same call (median us), and the traced one too, so the
trace's own cost is on record; the traced output must equal the untraced one bit for bit.

Usage: PYTHONPATH=.:bench python3 bench/ws_trace.py [--cases MASK:B:H:L:D:dtype ...]
Writes ``$OUT/ws-trace-<gpu>-<date>.jsonl`` (and the raw records as .npz) when OUT is set.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import numpy as np
from attention_timing import MASKS

from stofc.codegen import render
from stofc.compile import compile_source
from stofc.kernels.attention import KernelSpec, smem_bytes
from stofc.kernels.attention.render import COMPILE_OPTIONS
from stofc.kernels.attention.ws import AttentionWs
from stofc.kernels.attention.ws_cost import ws_config
from stofc.kernels.attention.ws_plan import consumers_of, plan_ws
from stofc.masks import encode
from stofc.runtime import module as rt_module
from stofc.runtime.attention import AttentionOp
from stofc.runtime.module import load_kernel
from stofc.targets import detect

TRACE_WORKS = 32          # records per block and warpgroup (works past it are not traced)
TRACE_BLOCKS = 160        # the template's
TRACE_STEPS = 32          # the template's: steps stamped per work
FIELDS = 8


def rand(shape, dtype: str, rng):
    """Normal values as the kernel's dtype (bfloat16 as its 16-bit patterns), on the GPU."""
    import cupy as cp

    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "bfloat16":
        return cp.asarray((x.view(np.uint32) >> 16).astype(np.uint16))
    return cp.asarray(x.astype(np.float16))


def time_us(fn, stream, reps: int = 50) -> float:
    """Median microseconds of ``fn()`` on ``stream`` over ``reps`` events-timed runs."""
    import cupy as cp

    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
    return float(np.median(times))


def summarise(rec: np.ndarray, head: np.ndarray, consumers: int) -> dict:
    """The launch's figures from the trace (module doc). ``rec``: [blocks, C + 1, works, 8],
    ``head``: [blocks, 8] = (smid, ns start, ns end, clock start, clock end)."""
    blocks = int((head[:, 1] > 0).sum())
    head = head[:blocks].astype(np.int64)
    rec = rec[:blocks].astype(np.int64)
    t0 = head[:, 1].min()
    start, end = head[:, 1] - t0, head[:, 2] - t0
    ghz = float(np.median((head[:, 4] - head[:, 3]) / np.maximum(head[:, 2] - head[:, 1], 1)))
    out: dict = {"blocks": blocks, "clock_ghz": round(ghz, 3),
                 "span_us": round(float(end.max()) / 1e3, 2),
                 "start_skew_us": round(float(start.max()) / 1e3, 2),
                 "end_us_p50_p90_max": [round(float(np.percentile(end, q)) / 1e3, 2)
                                        for q in (50, 90, 100)]}
    cons = rec[:, 1:]                                  # [blocks, C, works, 8]
    live = cons[..., 1] > 0
    q = cons[..., 2] - cons[..., 1]
    loop = cons[..., 3] - cons[..., 2]
    epi = cons[..., 4] - cons[..., 3]
    steps = cons[..., 7] >> 32
    computed = cons[..., 7] & 0xFFFFFFFF
    nxt = np.roll(cons[..., 1], -1, axis=2)
    nxt_live = np.roll(live, -1, axis=2)
    nxt_live[..., -1] = False
    gap = nxt - cons[..., 4]

    def mean(a, m=live):
        return round(float(a[m].mean()), 0) if m.any() else None

    out["works"] = int(live.sum() // consumers)
    out["per_work_cycles"] = {
        "q_wait": mean(q), "steps": mean(loop), "epilogue": mean(epi),
        "gap_to_next": mean(gap, live & nxt_live), "k_wait": mean(cons[..., 5]),
        "turn_wait": mean(cons[..., 6]), "steps_walked": mean(steps),
        "steps_computed": mean(computed)}
    out["cycles_per_computed_step"] = round(float(loop[live].sum() / max(computed[live].sum(), 1)), 0)
    out["cycles_per_walked_step"] = round(float(loop[live].sum() / max(steps[live].sum(), 1)), 0)
    first = np.where(live[..., 0], cons[..., 0, 1], 0)
    out["first_work_after_start_cycles"] = round(float((first[live[..., 0]] - np.repeat(
        head[:, 3:4], consumers, axis=1)[live[..., 0]]).mean()), 0)
    last_end = np.where(live, cons[..., 4], 0).max(axis=2)         # [blocks, C]
    out["wg_done_before_block_end_cycles"] = round(float(
        (head[:, 4:5] - last_end).mean()), 0)
    # where the warpgroups' time goes, summed over the launch: share of each phase
    busy = (cons[..., 4] - cons[..., 1])[live].sum()
    total = float(((head[:, 4] - head[:, 3])[:, None] * np.ones((1, consumers))).sum())
    out["share_of_block_cycles"] = {
        "q_wait": round(float(q[live].sum()) / total, 3),
        "steps": round(float(loop[live].sum()) / total, 3),
        "k_wait_in_steps": round(float(cons[..., 5][live].sum()) / total, 3),
        "turn_wait_in_steps": round(float(cons[..., 6][live].sum()) / total, 3),
        "epilogue": round(float(epi[live].sum()) / total, 3),
        "between_works": round(1.0 - float(busy) / total, 3)}
    prod = rec[:, 0]
    plive = prod[..., 1] > 0
    if plive.any():
        out["producer_per_work_cycles"] = {
            "slot_wait": round(float(prod[..., 4][plive].mean()), 0),
            "q_slot_wait": round(float((prod[..., 2] - prod[..., 1])[plive].mean()), 0),
            "issue_span": round(float((prod[..., 3] - prod[..., 1])[plive].mean()), 0),
            "tiles": round(float(prod[..., 5][plive].mean()), 1)}
    b = int(np.argmax(end))
    lb = []
    for k in range(cons.shape[2]):
        if not live[b, :, k].any():
            continue
        c0 = head[b, 3]
        lb.append({"work": int(cons[b, 0, k, 0]),
                   "start": [int(x - c0) for x in cons[b, :, k, 1]],
                   "steps": [int(x) for x in (cons[b, :, k, 3] - cons[b, :, k, 2])],
                   "end": [int(x - c0) for x in cons[b, :, k, 4]],
                   "computed": [int(x) for x in computed[b, :, k]],
                   "walked": int(steps[b, 0, k])})
    out["last_block"] = {"block": b, "end_us": round(float(end[b]) / 1e3, 2),
                         "clock_span": int(head[b, 4] - head[b, 3]), "works": lb}
    return out


def work_items(plan, works: np.ndarray, heads: int, batch: int, seq_len: int) -> np.ndarray:
    """The plan item ``[n, ITEM_FIELDS]`` of each work index of a launch of ``seq_len`` rows
    (the kernel's ``work_at``: head ``w % heads``, then batch, then the launch's item order;
    one format head or one per head; no residue split)."""
    offset = plan.launch_items(seq_len)[0]
    works = np.asarray(works, np.int64)
    h = works % heads
    idx = works // heads // batch
    f = h if plan.num_heads > 1 else np.zeros_like(h)
    order = np.asarray(plan.orders)[f, offset + idx]
    return np.asarray(plan.items)[f, order]


def by_kind(rec: np.ndarray, plan, heads: int, batch: int, seq_len: int) -> dict:
    """Per kind of work (a shared chunk: every warpgroup on one tile row, each on every C-th
    entry; any other work): the consumers' cycles per walked entry through their steps and
    waiting for K, and the producer's own cycles per loaded tile (its span past the Q
    buffer's wait, less its waits for free ring slots). Where the producer's own cycles per
    tile reach the consumers' per entry, the producer paces the walk
    (``ws-trace-h200-2026-11-28``: shared chunks, ~0.9k cycles a tile)."""
    rec = rec.astype(np.int64)
    prod = rec[:, 0]
    live = (prod[..., 3] > 0) & (prod[..., 5] > 0)
    # the consumers' record of the same work: the producer counts every work of its deal,
    # the consumers only those it handed over, so the k-th records may differ in work
    cons_at = np.zeros(prod.shape[:2], np.int64)
    for b, k in zip(*np.nonzero(live), strict=True):
        mine = np.nonzero((rec[b, 1, :, 0] == prod[b, k, 0]) & (rec[b, 1, :, 4] > 0))[0]
        live[b, k] = mine.size > 0
        cons_at[b, k] = mine[0] if mine.size else 0
    blocks, ks = np.nonzero(live)
    items = work_items(plan, prod[blocks, ks, 0], heads, batch, seq_len)
    shared = items[:, 4] > 0
    cons = rec[blocks, 1:, cons_at[blocks, ks]]          # [works, C, 8]
    walked = (items[:, 2] - items[:, 1]).astype(np.float64)
    steps = (cons[..., 3] - cons[..., 2]).mean(axis=1)
    kwait = cons[..., 5].mean(axis=1)
    p = prod[live]
    own = ((p[:, 3] - p[:, 2]) - p[:, 4]) / p[:, 5]
    out = {}
    for name, sel in (("shared", shared), ("other", ~shared)):
        if not sel.any():
            continue
        out[name] = {"works": int(sel.sum()), "walked": round(float(walked[sel].mean()), 1),
                     "steps_per_entry": round(float((steps[sel] / walked[sel]).mean()), 0),
                     "k_wait_per_entry": round(float((kwait[sel] / walked[sel]).mean()), 0),
                     "producer_own_per_tile": round(float(own[sel].mean()), 0),
                     "producer_slot_wait": round(float(p[sel, 4].mean()), 0)}
    return out


def step_kinds(rec: np.ndarray, steps: np.ndarray, plan, heads: int, batch: int,
               seq_len: int, kstep: int = 1) -> dict:
    """Where a shared chunk's steps go, per kind of step of a warpgroup: ``computed`` (the
    chunk's entry i is warpgroup i % C's), ``after_computed`` (a skipped step that issues
    and waits for the computed one's P V) and ``skipped``; ``other`` pools every step of the
    other works. Per kind: steps, mean cycles from one step's K wait to the next one's (the
    last step: to the end of the work's steps) and mean cycles waiting for K (not the
    ping-pong turn after it). ``rec``: the records ``[blocks, C + 1, works, 8]``; ``steps``:
    the per-step stamps ``[blocks, C, works, S, 2]`` (cycles from the work's first step to
    the start and to the end of the step's K wait); steps past S are not stamped and not
    counted."""
    rec = rec.astype(np.int64)
    steps = steps.astype(np.int64)
    C, S = steps.shape[1], steps.shape[3]
    acc: dict[str, list[list[int]]] = {k: [[], []] for k in
                                       ("computed", "after_computed", "skipped", "other")}
    for w in range(C):
        cons = rec[:, 1 + w]
        blocks, ks = np.nonzero(cons[..., 4] > 0)
        if blocks.size == 0:
            continue
        items = work_items(plan, cons[blocks, ks, 0], heads, batch, seq_len)
        for b, k, item in zip(blocks, ks, items, strict=True):
            n = int(cons[b, k, 7] >> 32)                 # the work's steps
            ns = min(n, S)
            if ns == 0:
                continue
            st = steps[b, w, k, :ns]
            ends = np.append(st[1:, 0], cons[b, k, 3] - cons[b, k, 2])
            dur, wait = ends - st[:, 0], st[:, 1] - st[:, 0]
            shared = item[4] > 0
            prev = False
            # past S steps the last stamped one's end is unknown: it is left out
            for t in range(ns if n <= S else S - 1):
                mine = shared and any((kstep * t + hh) % C == w for hh in range(kstep))
                kind = ("other" if not shared else "computed" if mine
                        else "after_computed" if prev else "skipped")
                prev = mine
                acc[kind][0].append(int(dur[t]))
                acc[kind][1].append(int(wait[t]))
    return {k: {"steps": len(d), "cycles": round(float(np.mean(d)), 0),
                "k_wait": round(float(np.mean(wt)), 0)}
            for k, (d, wt) in acc.items() if d}


def _global_array(module, name: str, count: int, dtype):
    """The module's ``__device__`` array ``name`` (``count`` elements of ``dtype``) as a
    CuPy array over its memory (not a copy)."""
    import cupy as cp

    ptr = module.get_global_var(name)
    if not isinstance(ptr, int):                    # a MemoryPointer in some CuPy versions
        ptr = int(ptr.ptr)
    mem = cp.cuda.UnownedMemory(ptr, count * cp.dtype(dtype).itemsize, owner=None)
    return cp.ndarray((count,), dtype, cp.cuda.MemoryPointer(mem, 0))


def main() -> int:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="longformer:1:12:8192:64:float16 "
                    "bigbird:1:12:8192:64:float16 longformer:1:12:16384:64:float16 "
                    "dense:4:12:4096:64:float16 dense:1:12:8192:64:float16 "
                    "cw4095:2:12:16384:64:float16")
    args = ap.parse_args()
    profile = detect()
    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    rows = []
    raw = {}
    for case in args.cases.split():
        mask, B, H, L, D, dtype = case.rsplit(":", 5)
        B, H, L, D = int(B), int(H), int(L), int(D)
        fmt = encode(MASKS.get(mask, mask), L)
        cfg = ws_config(fmt, profile, batch=B, heads=H, head_dim=D)
        assert cfg is not None, case
        C = consumers_of(cfg.warps)
        q, k, v = (rand((B, L, H, D), dtype, rng) for _ in range(3))
        op = AttentionOp(fmt, cfg, dtype, D, profile)
        out_plain, out_trace = cp.zeros_like(q), cp.zeros_like(q)
        plain = op.bind(q, k, v, out_plain)
        us_plain = time_us(lambda b=plain: b.launch(stream), stream)
        spec = KernelSpec(cfg, dtype, D)
        values = {**AttentionWs().template_values(spec), "trace_works": TRACE_WORKS}
        src = render(spec.template, spec.name + "_trace", (spec.name, spec.name + "_combine"),
                     **values)
        compiled = compile_source(src, "sm_90a", options=COMPILE_OPTIONS)
        key = (False, False, False)          # (bias, key bits, soft-capping): none here
        op._kernels[key] = (load_kernel(compiled, spec.name, dynamic_smem=smem_bytes(cfg, D),
                                        shared_blocks=cfg.min_blocks),
                            load_kernel(compiled, spec.name + "_combine"))
        traced = op.bind(q, k, v, out_trace)
        us_trace = time_us(lambda b=traced: b.launch(stream), stream)
        words = (TRACE_BLOCKS * (C + 1) * TRACE_WORKS + TRACE_BLOCKS) * FIELDS
        module = rt_module._MODULES[compiled.key]
        trace = _global_array(module, spec.name + "_trace", words, cp.uint64)
        steps_dev = _global_array(module, spec.name + "_steps",
                                  TRACE_BLOCKS * C * TRACE_WORKS * TRACE_STEPS * 2, cp.uint32)
        trace.fill(0)
        steps_dev.fill(0)
        cp.cuda.Device().synchronize()         # the fill ran on the default stream
        traced.launch(stream)
        stream.synchronize()
        host = cp.asnumpy(trace)
        head_at = TRACE_BLOCKS * (C + 1) * TRACE_WORKS * FIELDS
        rec = host[:head_at].reshape(TRACE_BLOCKS, C + 1, TRACE_WORKS, FIELDS)
        head = host[head_at:].reshape(TRACE_BLOCKS, FIELDS)
        stamps = cp.asnumpy(steps_dev).reshape(TRACE_BLOCKS, C, TRACE_WORKS, TRACE_STEPS, 2)
        same = bool(cp.array_equal(out_plain, out_trace))
        row = {"case": case, "config": op.family.describe(cfg), "us": round(us_plain, 1),
               "us_traced": round(us_trace, 1), "traced_output_identical": same,
               **summarise(rec, head, C)}
        if cfg.period == 1:                   # the launch's walk (ws_launch_data's plan)
            plan = plan_ws(fmt, split_tiles=cfg.split, consumers=C, split_rows=cfg.split_rows)
            row["by_kind"] = by_kind(rec, plan, H, B, L)
            row["step_kinds"] = step_kinds(rec, stamps, plan, H, B, L, cfg.kstep)
        rows.append(row)
        raw[case.replace(":", "_")] = host
        raw[case.replace(":", "_") + "_steps"] = stamps
        print(json.dumps(row), flush=True)
    out = os.environ.get("OUT")
    if out:
        gpu = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
        tag = "h200" if "H200" in gpu else "h100" if "H100" in gpu else "gpu"
        stem = Path(out, f"ws-trace-{tag}-{datetime.date.today().isoformat()}")
        stem.with_suffix(".jsonl").write_text("".join(json.dumps({"gpu": gpu, **r}) + "\n"
                                                      for r in rows))
        np.savez_compressed(stem.with_suffix(".npz"), **raw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
