"""Issue 15, outside stofc: the same Llama in torch, bfloat16 against float32.

How far is bfloat16 from float32 on ``bench/e2e_long_models.py``'s ``llama`` (seed-0
random weights, rebuilt exactly as it was exported), measured the way compile's check and
``stofc verify`` measure a package (max |x - ref| / max |ref| over real tokens), on the
check's inputs: ``model.to(torch.bfloat16)`` (weights and activations bf16, as a bf16
checkpoint runs) and ``torch.autocast("cpu", torch.bfloat16)`` (matmul operands bf16;
adds, norms and softmax float32). The float32 model is the reference.

Needs torch and transformers (not in stofc's venv: the export environment,
``bench/e2e_long_models.py``). The inputs come from ``bench/bf16_llama_error_budget.py
MODEL --save-feeds FEEDS.npz`` (stofc's own ``make_inputs``, seeds 0..N-1).

Usage: python bench/bf16_llama_torch.py FEEDS.npz [--small] [--attn sdpa]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> None:
    import e2e_long_models as models
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("feeds", type=Path)
    ap.add_argument("--small", action="store_true", help="the toy-size llama")
    ap.add_argument("--attn", default="sdpa", help="transformers attention implementation")
    ns = ap.parse_args(argv)
    feeds = np.load(ns.feeds)
    seeds = sorted(int(k[len("real"):]) for k in feeds.files if k.startswith("real"))
    ref_model = models.build("llama", small=ns.small, attn=ns.attn)
    bf16_model = models.build("llama", small=ns.small, attn=ns.attn).to(torch.bfloat16)
    print(f"llama{' (small)' if ns.small else ''}, {ns.attn}, fingerprint "
          f"{models.fingerprint(ref_model)}, torch {torch.__version__}")
    print("| seed | model.to(bf16) | autocast(bf16) |\n| --- | --- | --- |")
    for seed in seeds:
        ids = torch.from_numpy(feeds[f"input_ids{seed}"])
        mask = torch.from_numpy(feeds[f"attention_mask{seed}"])
        real = feeds[f"real{seed}"]
        with torch.no_grad():
            ref = ref_model(input_ids=ids, attention_mask=mask).last_hidden_state.double()
            full = bf16_model(input_ids=ids, attention_mask=mask).last_hidden_state.double()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                auto = ref_model(input_ids=ids, attention_mask=mask).last_hidden_state.double()
        print(f"| {seed} | {rel(full.numpy(), ref.numpy(), real):.3e} | "
              f"{rel(auto.numpy(), ref.numpy(), real):.3e} |")


def rel(out: np.ndarray, ref: np.ndarray, real: np.ndarray) -> float:
    """verify's max |out - ref| / max |ref| over real tokens."""
    return float(np.abs(out - ref)[real].max() / np.abs(ref)[real].max())


if __name__ == "__main__":
    main()
