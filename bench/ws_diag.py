"""Where the attention time of long-L_max packages goes (a development probe, issue 14/18).

Three questions, one GPU call, each output checked against a float32 SDPA reference:

1. **Short runs of a long package.** A package compiled for L_max = 16384 runs its bucket
   picks (block-wise at 128 tokens, ws at 512) on the top-left corner of the L_max mask
   format. Time the same config on the format encoded at L_max and at the run's length,
   with the walk trimmed by ``trim_walk``'s rounds (last/first key, the consecutive-tile
   guess) and with the plain binary search they replaced swapped in (before 2026-11-26
   afternoon: a linear loop against that search), for Longformer, BigBird and causal
   (B=1 S=128, B=8 S=512).
2. **BERT-base at (1, 8192).** The package's bucket pick (ws, the selector's split) on the
   format encoded at 32768 and at 8192, with and without key bits (the package passes the
   attention mask as key bits): the e2e profile had 2.06 ms of attention for Longformer
   against ~1.2 ms estimated.
3. **The dense ws kernel now** (after the per-warp V release): dense and causal at the
   issue-14 shapes against cuDNN SDPA, same run.

Usage: PYTHONPATH=. python3 bench/ws_diag.py [--parts short,bert,dense] ; prints JSON lines,
then a summary table; writes ``$OUT/ws-diag-<gpu>-<date>.jsonl`` when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re

import cupy as cp
import torch
import torch.nn.functional as F
from attention_timing import cupy_view
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from stofc.compile import compile_source
from stofc.kernels.attention import render_kernel, select_kernel
from stofc.kernels.attention.select import choose_attention
from stofc.masks import encode, to_dense
from stofc.runtime.attention import AttentionOp
from stofc.runtime.module import load_kernel
from stofc.targets import detect

BERT = {"longformer": "longformer:window=256,global=16",
        "bigbird": "bigbird:block=64,window=3,global=2,random=3,seed=0",
        "causal": "causal"}
OLD_TRIM = {  # the plain binary search trim_walk's guess round replaced (8096d6b), by template
    "j1 = trim_walk(tile_key, j0, j1, kvl, TILE);":
        "{ int a = j0, b = j1; while (a < b) { const int m = (a + b) >> 1; "
        "if (tile_key[m] >= kvl) b = m; else a = m + 1; } j1 = b; }",
    "end = trim_walk(entry_key, x.begin, end, x.kvl, TILE);":
        "{ int a = x.begin, b = end; while (a < b) { const int m = (a + b) >> 1; "
        "if (entry_key[m] >= x.kvl) b = m; else a = m + 1; } end = b; }",
}


def tdt(dt: str):
    return torch.bfloat16 if dt == "bfloat16" else torch.float16


def reference(q, k, v, dense) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)),
                                              attn_mask=dense).transpose(1, 2)


def first_rows_reference(q, k, v, mask_rows) -> torch.Tensor:
    """float32 attention of q's first ``mask_rows.shape[0]`` queries over every key."""
    n = mask_rows.shape[0]
    qs, kt, vt = q[:, :n].float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2)
    s = (qs @ kt.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~mask_rows, float("-inf"))
    return (torch.softmax(s, dim=-1) @ vt).transpose(1, 2)


def relerr(out, ref) -> float:
    o = out.float()
    if not torch.isfinite(o).all():
        return float("nan")
    return ((o - ref).norm() / ref.norm()).item()


def swap_old_trim(op: AttentionOp, key: tuple[bool, bool, bool]) -> None:
    """Replace the op's kernels of ``key`` by the same source with the old linear trim."""
    spec = op.spec(has_bias=key[0], has_key_bits=key[1], has_softcap=key[2])
    src = render_kernel(spec)
    code = src.code
    for new, old in OLD_TRIM.items():
        code = code.replace(new, old)
    assert code != src.code, "no trim_walk call found to swap"
    compiled = compile_source(dataclasses.replace(src, code=code),
                              op.family.target_for(op.config, op.target),
                              options=op.family.compile_options)
    smem = op.family.dynamic_smem(op.config, op.head_dim)
    op._kernels[key] = tuple(load_kernel(compiled, e, dynamic_smem=smem if i == 0 else 0)
                             for i, e in enumerate(op.family.entry_points(spec)))


def time_op(op: AttentionOp, q, k, v, *, key_mask=None, old=False) -> tuple[float, torch.Tensor]:
    out = torch.full_like(q, float("nan"))
    km = None if key_mask is None else cp.asarray(key_mask)
    bound = op.bind(cupy_view(q), cupy_view(k), cupy_view(v), cupy_view(out), key_mask=km)
    if old:
        swap_old_trim(op, (False, key_mask is not None, False))
        bound = op.bind(cupy_view(q), cupy_view(k), cupy_view(v), cupy_view(out), key_mask=km)
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    bound.launch(stream)
    torch.cuda.synchronize()
    ms = do_bench(lambda: bound.launch(stream), warmup=25, rep=100, return_mode="median")
    return ms, out


def short_part(profile, rows: list[dict]) -> None:
    """Question 1: the bucket picks at (1, 128) and (8, 512) on L_max 16384 vs the run's L."""
    for mask, spec in BERT.items():
        for batch, seq in ((1, 128), (8, 512)):
            small = encode(spec, seq)
            pick, variants = choose_attention(small, profile, batch=batch, heads=12,
                                              seq_len=seq, head_dim=64)
            cfg = next((v.choice.config for v in variants
                        if batch * -(-seq // 64) <= (v.max_batch_rows or 1 << 30)), pick.config)
            q, k, v = (torch.randn(batch, seq, 12, 64, device="cuda", dtype=torch.float16)
                       for _ in range(3))
            key_mask = torch.ones(batch, seq, dtype=torch.int32, device="cuda")
            for lmax in (seq, 16384):
                fmt = encode(spec, lmax)      # a run reads the top-left corner of L_max's mask
                ref = reference(q, k, v, torch.from_numpy(to_dense(fmt, size=seq)).cuda())
                for old in (False, True):
                    op = AttentionOp(fmt, cfg, "float16", 64, profile)
                    ms, out = time_op(op, q, k, v, key_mask=key_mask, old=old)
                    row = {"part": "short", "mask": mask, "B": batch, "S": seq, "L_max": lmax,
                           "trim": "bsearch" if old else "rounds", "config": cfg.describe(),
                           "us": round(ms * 1e3, 2), "relerr": round(relerr(out, ref), 5)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)


def bert_part(profile, rows: list[dict]) -> None:
    """Question 2: BERT-base attention at (1, 8192), package pick, L_max 32768 vs 8192."""
    seq = 8192
    for mask, spec in BERT.items():
        small = encode(spec, seq)
        pick = select_kernel(small, profile, batch=1, heads=12, seq_len=seq, head_dim=64)
        q, k, v = (torch.randn(1, seq, 12, 64, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        for lmax in (seq, 32768):
            fmt = encode(spec, lmax)
            dense = torch.from_numpy(to_dense(fmt, size=seq)).cuda()
            nnz = int(dense.sum())
            ref = reference(q, k, v, dense)
            for keys in (False, True):
                op = AttentionOp(fmt, pick.config, "float16", 64, profile)
                km = torch.ones(1, seq, dtype=torch.int32, device="cuda") if keys else None
                ms, out = time_op(op, q, k, v, key_mask=km)
                row = {"part": "bert", "mask": mask, "L_max": lmax, "key_bits": keys,
                       "config": pick.config.describe(), "us": round(ms * 1e3, 1),
                       "x12_ms": round(12 * ms, 3), "tflops": round(4 * 12 * 64 * nnz / ms / 1e9, 1),
                       "est_us": round(pick.estimate(pick.kernel), 1),
                       "relerr": round(relerr(out, ref), 5)}
                print(json.dumps(row), flush=True)
                rows.append(row)


def dense_part(profile, rows: list[dict]) -> None:
    """Question 3: the ws kernel (selector pick) on dense and causal vs cuDNN."""
    for case in ("1:16:16384:128:bfloat16", "2:12:16384:64:float16", "4:12:4096:64:float16"):
        b, h, length, d, dt = case.split(":")
        B, H, L, D = int(b), int(h), int(length), int(d)
        q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=tdt(dt)) for _ in range(3))
        for mask in ("dense", "causal"):
            fmt = encode(mask, L)
            dense = torch.from_numpy(to_dense(fmt)).cuda()
            nnz = int(dense.sum())
            pick = select_kernel(fmt, profile, batch=B, heads=H, seq_len=L, head_dim=D)
            op = AttentionOp(fmt, pick.config, dt, D, profile)
            ms, out = time_op(op, q, k, v)
            rows_ = 256                        # the reference for the first query rows only
            ref = first_rows_reference(q, k, v, dense[:rows_])
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cudnn = do_bench(lambda qt=qt, kt=kt, vt=vt, m=mask: F.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=m == "causal"), warmup=25, rep=100, return_mode="median")
            err = relerr(out[:, :rows_], ref)
            row = {"part": "dense", "case": case, "mask": mask, "config": pick.config.describe(),
                   "tflops": round(4 * B * H * D * nnz / ms / 1e9, 1),
                   "cudnn_tflops": round(4 * B * H * D * nnz / cudnn / 1e9, 1),
                   "vs_cudnn": round(cudnn / ms, 3), "relerr_first_rows": round(err, 5)}
            print(json.dumps(row), flush=True)
            rows.append(row)


FAMILIES = {"dense": "dense", "causal": "causal", "local64": "sliding:window=64",
            "local256": "sliding:window=256", **BERT}


def ws_config(consumers: int, stages: int = 2, pingpong: bool = True, split: int = 0):
    from stofc.kernels.attention import AttentionConfig
    return AttentionConfig("ws", 64, 16, 4 * (consumers + 1), stages, 1, mma="wgmma",
                           pingpong=pingpong, split=split)


def consumers_part(profile, rows: list[dict]) -> None:
    """Question 4: two vs three consumer warpgroups (FlashAttention-3's head_dim-64 block)."""
    from stofc.kernels.attention.ws_plan import default_split
    for case in ("4:12:4096:64:float16", "2:12:16384:64:float16", "1:12:8192:64:float16"):
        b, h, length, d, dt = case.split(":")
        B, H, L, D = int(b), int(h), int(length), int(d)
        q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=tdt(dt)) for _ in range(3))
        for mask, spec in FAMILIES.items():
            fmt = encode(spec, L)
            dense = to_dense(fmt)
            nnz = int(dense.sum())
            ref = first_rows_reference(q, k, v, torch.from_numpy(dense[:256].copy()).cuda())
            del dense
            row = {"part": "consumers", "case": case, "mask": mask}
            for name, c, stages, pp in (("c2", 2, 2, True), ("c3", 3, 2, True),
                                        ("c2s3", 2, 3, True), ("c3s3", 3, 3, True),
                                        ("c3nopp", 3, 2, False)):
                split = default_split(fmt, batch=B, heads=H, sm_count=profile.sm_count,
                                      consumers=c)
                cfg = ws_config(c, stages, pp, split)
                try:
                    op = AttentionOp(fmt, cfg, dt, D, profile)
                    ms, out = time_op(op, q, k, v)
                    err = relerr(out[:, :256], ref)
                    row[name] = {"us": round(ms * 1e3, 1), "err": round(err, 5), "split": split,
                                 "tflops": round(4 * B * H * D * nnz / ms / 1e9, 1)}
                except Exception as e:  # recorded: a variant may fail to compile or run
                    row[name] = repr(e)[:200]
            print(json.dumps(row), flush=True)
            rows.append(row)


def lmax_part(profile, rows: list[dict]) -> None:
    """Question 5: why the L_max 32768 format runs BERT's (1, 8192) slower: splits."""
    seq = 8192
    q, k, v = (torch.randn(1, seq, 12, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    for mask in ("longformer", "bigbird"):
        for lmax in (8192, 32768):
            fmt = encode(BERT[mask], lmax)
            for split in (0, 16, 32, 64):
                op = AttentionOp(fmt, ws_config(2, split=split), "float16", 64, profile)
                ms, _ = time_op(op, q, k, v)
                row = {"part": "lmax", "mask": mask, "L_max": lmax, "split": split,
                       "us": round(ms * 1e3, 1),
                       "items": op._launch.ws.plan.launch_items(seq)[1]}
                print(json.dumps(row), flush=True)
                rows.append(row)


def short2_part(profile, rows: list[dict]) -> None:
    """Question 6: which kernel serves the short shapes (e2e's "never slower" points)? The
    block-wise pick (and its query-split variant) vs ws with 2/3 consumers and 2/3 stages,
    against cuDNN's dense (or is_causal) attention of the same shape: what ORT runs."""
    from stofc.kernels.attention import AttentionConfig
    block = AttentionConfig("block", 64, 16, 4, 2, 1, min_blocks=4, mma="wgmma")
    qsplit = AttentionConfig("block", 64, 16, 2, 2, 2, min_blocks=5)
    variants = {"block": block, "block_q2": qsplit, "c2s2": ws_config(2, 2), "c2s3": ws_config(2, 3),
                "c3s3": ws_config(3, 3)}
    for batch, seq in ((1, 128), (8, 512), (2, 512), (4, 2048), (1, 2048)):
        q, k, v = (torch.randn(batch, seq, 12, 64, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        cudnn = {}
        for causal in (False, True):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cudnn[causal] = do_bench(lambda c=causal, a=(qt, kt, vt): F.scaled_dot_product_attention(
                    *a, is_causal=c), warmup=25, rep=100, return_mode="median")
        for mask, spec in BERT.items():
            fmt = encode(spec, seq)
            ref = reference(q, k, v, torch.from_numpy(to_dense(fmt)).cuda())
            row = {"part": "short2", "B": batch, "S": seq, "mask": mask,
                   "cudnn_dense_us": round(cudnn[False] * 1e3, 1),
                   "cudnn_causal_us": round(cudnn[True] * 1e3, 1)}
            for name, cfg in variants.items():
                try:
                    op = AttentionOp(fmt, cfg, "float16", 64, profile)
                    ms, out = time_op(op, q, k, v, key_mask=torch.ones(
                        batch, seq, dtype=torch.int32, device="cuda"))
                    row[name] = {"us": round(ms * 1e3, 1), "err": round(relerr(out, ref), 5)}
                except Exception as e:  # recorded: a variant may not fit the shape
                    row[name] = repr(e)[:160]
            print(json.dumps(row), flush=True)
            rows.append(row)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="short,bert,dense")
    args = ap.parse_args()
    profile = detect()
    rows: list[dict] = []
    for part in args.parts.split(","):
        {"short": short_part, "bert": bert_part, "dense": dense_part,
         "consumers": consumers_part, "lmax": lmax_part, "short2": short2_part}[part](
            profile, rows)
    if os.environ.get("OUT"):
        gpu = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
        day = datetime.date.today().isoformat()
        path = os.path.join(os.environ["OUT"], f"ws-diag-{gpu}-{day}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
