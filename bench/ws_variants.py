"""Variants of the warp-specialised kernel timed side by side (a development probe).

Each variant re-renders ``templates/attention/block_ws.cu.j2`` with some template values
overridden (e.g. ``q_in_regs=false``: S = Q K^T reads Q from smem), compiles it for
sm_90a and swaps it into an :class:`AttentionOp` of the same config, so the walk, the
launch and the check are the product's. Each output is checked against SDPA in float32.
Usage: PYTHONPATH=. python3 bench/ws_variants.py [--cases B:H:L:D:dtype ...]
"""

from __future__ import annotations

import argparse
import json

import cupy as cp
import torch
import torch.nn.functional as F
from triton.testing import do_bench

from stofc.codegen import render
from stofc.compile import compile_source
from stofc.kernels.attention import AttentionConfig, KernelSpec, smem_bytes
from stofc.kernels.attention.render import COMPILE_OPTIONS, ws_template_values
from stofc.masks import encode, to_dense
from stofc.runtime.attention import AttentionOp
from stofc.runtime.module import load_kernel
from stofc.targets import detect

VARIANTS = {                       # name: (config overrides, template overrides)
    "base": ({}, {}),
    "q_smem": ({}, {"q_in_regs": "false"}),
    "no_pingpong": ({"pingpong": False}, {}),
    "stages3": ({"stages": 3}, {}),
    "kstep2": ({"kstep": 2, "stages": 4}, {}),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1:16:8192:128:bf16 2:12:8192:64:fp16")
    ap.add_argument("--masks", default="dense,causal")
    args = ap.parse_args()
    profile = detect()
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    for case in args.cases.split():
        B, H, L, D, dt = case.split(":")
        B, H, L, D = int(B), int(H), int(L), int(D)
        tdt = torch.bfloat16 if dt == "bf16" else torch.float16
        sdt = "bfloat16" if dt == "bf16" else "float16"
        q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=tdt) for _ in range(3))

        def cpv(x, tdt=tdt):
            return cp.asarray(x) if tdt == torch.float16 else cp.asarray(x.view(torch.int16)).view(cp.uint16)

        qc, kc, vc = (cpv(x) for x in (q, k, v))
        for mask in args.masks.split(","):
            fmt = encode(mask, L)
            dense = torch.from_numpy(to_dense(fmt)).cuda()
            nnz = int(dense.sum())
            ref = F.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)),
                                                 attn_mask=dense).transpose(1, 2)
            row = {"case": case, "mask": mask}
            for name, (cfg_over, tpl_over) in VARIANTS.items():
                cfg = AttentionConfig("ws", 64, 16, 12, 2, 1, mma="wgmma", pingpong=True)
                cfg = AttentionConfig(**{**cfg.__dict__, **cfg_over})
                try:
                    op = AttentionOp(fmt, cfg, sdt, D, profile)
                    spec = KernelSpec(cfg, sdt, D)
                    values = {**ws_template_values(spec), **tpl_over}
                    values["kernel_name"] = spec.name
                    src = render(spec.template, spec.name + "_" + name,
                                 (spec.name, spec.name + "_combine"), **values)
                    compiled = compile_source(src, "sm_90a", options=COMPILE_OPTIONS)
                    key = (False, False, False)
                    op._kernels[key] = load_kernel(compiled, spec.name,
                                                   dynamic_smem=smem_bytes(cfg, D))
                    op._combines[key] = load_kernel(compiled, spec.name + "_combine")
                    out = torch.full_like(q, float("nan"))
                    bound = op.bind(qc, kc, vc, cpv(out))
                    bound.launch(stream)
                    torch.cuda.synchronize()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    ms = do_bench(lambda b=bound: b.launch(stream), warmup=25, rep=100,
                                  return_mode="median")
                    row[name] = (round(4 * B * H * D * nnz / ms / 1e9, 1), round(err, 4))
                except Exception as e:  # recorded: a variant may not compile or fit
                    row[name] = repr(e)[:160]
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
