"""Sustained load: stofc's kernel against FlashAttention-4 (and cuDNN where it runs the mask)
at the GPU's own clock and power, plus paired do_bench rounds.

Why: ``mha_hopper.py``'s paired ratios (each side timed in turn under load) read 2-9% below
its one-shot ratios for stofc on the causal and window rows, FA4's far less. The board
lowers its clock under a power cap, so a kernel that spends more energy per call than the
anchor loses time under sustained load that a one-shot timing after an idle spell hides.
This measures it: each side runs back to back for ``--seconds`` while ``nvidia-smi``
samples the board's power, SM clock and clock-event reasons every 50 ms; per side the
steady-state time per call (CUDA events over batches), the mean power and clock in its
window, and the energy per call (power x time). Then ``--rounds`` paired rounds of
``do_bench`` medians, as ``mha_hopper.py --paired``. Every output is checked against a
float32 reference of the mask (relative error).

Usage (GPU machine; FA4 from ``/tmp/fa4site``, ``../shared/scripts/fa4-wheel-parts.sh``):
    PYTHONPATH=.:bench python3 bench/power_pair.py [--cases B:H:L:D:dtype ...]
        [--masks dense,causal,causal_window4095] [--seconds 3] [--rounds 7]
Writes ``$OUT/power-pair-GPU-DATE.jsonl`` (one line per case and mask) and the raw samples.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import cupy as cp
import torch
import torch.nn.functional as F

# mha_hopper adds /tmp/fa4site to the path and imports FA4 where it is installed
from attention_timing import cupy_view
from mha_hopper import FA4_ERROR, MASKS, fa4, relerr
from power_log import read_samples, start_sampler, summarize
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from stofc.kernels.attention import select_kernel
from stofc.masks import encode, to_dense
from stofc.runtime.attention import AttentionOp
from stofc.targets import detect


def sustained(fn, seconds: float, batch: int = 20) -> dict:
    """``fn`` back to back for ``seconds`` (after a quarter of that as warm-up): host window
    and the per-call ms of each batch of ``batch`` calls (CUDA events)."""
    end = time.time() + seconds / 4
    while time.time() < end:
        for _ in range(batch):
            fn()
        torch.cuda.synchronize()
    t0 = time.time()
    per_call = []
    while time.time() < t0 + seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        per_call.append(a.elapsed_time(b) / batch)
    return {"t0": t0, "t1": time.time(), "ms": per_call}


def sides(fmt, profile, bshd, bhsd, cupy_in, sdtype, shape, stream, fa_mask, cudnn_causal,
          ref, rows) -> tuple[dict, dict]:
    """The calls timed for one case and mask (stofc's selector pick, FA4 where it expresses
    the mask, cuDNN where it runs it) and each output's relative error against ``ref``;
    ``calls["_config"]`` names stofc's config."""
    q, k, v = bshd
    qt, kt, vt = bhsd
    B, H, L, D = shape
    calls: dict = {}
    errs: dict = {}
    choice = select_kernel(fmt, profile, batch=B, heads=H, seq_len=L, head_dim=D)
    op = AttentionOp(fmt, choice.config, sdtype, D, profile)
    out = torch.full_like(q, float("nan"))
    bound = op.bind(*cupy_in, cupy_view(out), layout="bshd")
    calls["stofc"] = lambda: bound.launch(stream)
    calls["stofc"]()
    torch.cuda.synchronize()
    errs["stofc"] = relerr(out, ref, rows)
    if fa4 is not None and fa_mask is not None:
        causal, win = fa_mask
        o = fa4(q, k, v, causal=causal, window_size=win)
        errs["fa4"] = relerr(o[0] if isinstance(o, tuple) else o, ref, rows)
        calls["fa4"] = lambda: fa4(q, k, v, causal=causal, window_size=win)
    if cudnn_causal is not None:
        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=cudnn_causal)
        errs["cudnn"] = relerr(cudnn().transpose(1, 2), ref, rows)
        calls["cudnn"] = cudnn
    calls["_config"] = choice.config.describe()
    return calls, errs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="4:12:4096:64:fp16 2:12:16384:64:fp16 1:16:16384:128:bf16")
    ap.add_argument("--masks", default="dense,causal,causal_window4095")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if fa4 is None:
        print(f"FA4 missing: {FA4_ERROR}")
    profile = detect()
    gpu = torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "-").lower()
    day = datetime.date.today().isoformat()
    out_dir = os.environ.get("OUT", ".")
    smi_path = os.path.join(out_dir, f"power-pair-{gpu}-{day}-samples.csv")
    sampler = start_sampler(smi_path)
    time.sleep(1.0)
    results = []
    try:
        for case in args.cases.split():
            B, H, L, D, dt = case.split(":")
            B, H, L, D = int(B), int(H), int(L), int(D)
            dtype = torch.bfloat16 if dt == "bf16" else torch.float16
            sdtype = "bfloat16" if dt == "bf16" else "float16"
            torch.manual_seed(0)
            q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=dtype) for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            qc, kc, vc = (cupy_view(x) for x in (q, k, v))
            stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
            for name in args.masks.split(","):
                spec, fa_mask, cudnn_causal = MASKS[name]
                fmt = encode(spec, L, tile=64)
                dense = torch.from_numpy(to_dense(fmt)).cuda()
                rows = dense.any(-1)
                ref = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(),
                                                     attn_mask=dense).transpose(1, 2)
                calls, errs = sides(fmt, profile, (q, k, v), (qt, kt, vt), (qc, kc, vc),
                                    sdtype, (B, H, L, D), stream, fa_mask, cudnn_causal, ref, rows)
                choice_desc = calls.pop("_config")
                del ref
                rec = {"case": case, "mask": name, "stofc_config": choice_desc,
                       "relerr": {k2: round(e, 6) for k2, e in errs.items()}, "sustained": {}}
                runs = {}
                for key, fn in calls.items():        # each side, sustained, with a cool-down
                    time.sleep(1.0)
                    runs[key] = sustained(fn, args.seconds)
                times: dict[str, list[float]] = {key: [] for key in calls}
                for _ in range(args.rounds):
                    for key, fn in calls.items():
                        times[key].append(round(do_bench(fn, warmup=25, rep=100,
                                                         return_mode="median"), 4))
                rec["paired_ms"] = times
                med = {key: sorted(t)[len(t) // 2] for key, t in times.items()}
                rec["paired_median_ms"] = med
                if "fa4" in med:
                    rec["paired_vs_fa4"] = round(med["fa4"] / med["stofc"], 3)
                rec["_runs"] = runs
                results.append(rec)
                print(json.dumps({k2: v2 for k2, v2 in rec.items() if k2 != "_runs"}), flush=True)
                del dense
                torch.cuda.empty_cache()
    finally:
        time.sleep(0.5)
        sampler.terminate()
        sampler.wait()
    samples = read_samples(smi_path)
    path = os.path.join(out_dir, f"power-pair-{gpu}-{day}.jsonl")
    with open(path, "w") as f:
        for rec in results:
            runs = rec.pop("_runs")
            rec["sustained"] = {key: summarize(run, samples) for key, run in runs.items()}
            if "fa4" in rec["sustained"]:
                s = rec["sustained"]
                rec["sustained_vs_fa4"] = round(s["fa4"]["ms"] / s["stofc"]["ms"], 3)
            f.write(json.dumps(rec) + "\n")
            print(json.dumps({"case": rec["case"], "mask": rec["mask"],
                              "sustained": rec["sustained"],
                              "sustained_vs_fa4": rec.get("sustained_vs_fa4"),
                              "paired_vs_fa4": rec.get("paired_vs_fa4")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
