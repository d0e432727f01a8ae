"""Does a half-precision torch anchor compute the model it is timed against?

``e2e_long``'s fp16 torch sides (FlexAttention and SDPA) of the Llama-style decoder were
1.5-1.8e-1 (relative) away from the stofc package at (1, 8192), while the package was
1.9e-3 away from the same model in fp32 torch (bench/results/e2e-long-h100-2026-11-26-
modern-rope.md). The suspect: ``Module.to(float16)`` rounds RoPE's ``inv_freq`` buffer,
and transformers computes the angles from that rounded copy. This runs the models of
``bench/e2e_long_models.py`` with torch's SDPA (causal for the decoder, none for
ModernBERT's global layers: only the RoPE path differs between the sides) in fp32, in
fp16 as ``model.to`` leaves it, and in fp16 with the buffers kept in fp32
(:func:`e2e_torch.keep_rope_frequencies`), and prints each fp16 side's relative
difference from fp32 (largest absolute difference over the largest absolute value of
``last_hidden_state``, as ``e2e_long`` measures).

Usage (GPU machine, repo root): ``python3 bench/anchor_rope_check.py [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import torch
    from e2e_long_models import build
    from e2e_torch import keep_rope_frequencies

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--lengths", default="1024,8192")
    ap.add_argument("--models", default="llama,modernbert")
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        ref = build(name).to("cuda")
        naive = build(name).to(device="cuda", dtype=torch.float16)
        kept = keep_rope_frequencies(build(name), "cuda", torch.float16)
        for s in map(int, args.lengths.split(",")):
            torch.manual_seed(1)
            ids = torch.randint(10, 1000, (1, s), device="cuda")
            with torch.no_grad():
                want = ref(input_ids=ids).last_hidden_state.float()
                scale = want.abs().max().item()
                row = {"model": name, "S": s}
                for side, model in (("fp16 model.to", naive), ("fp16 inv_freq fp32", kept)):
                    got = model(input_ids=ids).last_hidden_state.float()
                    row[side] = (got - want).abs().max().item() / scale
            print(json.dumps(row), flush=True)
            rows.append(row)
        del ref, naive, kept
        torch.cuda.empty_cache()
    if args.out:
        gpu = torch.cuda.get_device_name().split()[1].lower()
        (args.out / f"anchor-rope-{gpu}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
