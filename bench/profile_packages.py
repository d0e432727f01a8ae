"""Kernel-level comparison of the analytical and the tuned package of one model, one device call.

Compiles HF BERT-base (bench/e2e_models.py's export) with BigBird twice: the analytical
package and ``compile --tune`` at (B, L) (one bucket), then, for each package at (B, L),
the median wall time of ``run_with_iobinding`` and the GPU time per kernel name
(torch.profiler / CUPTI, bench/profile_e2e.py's ``kernel_breakdown``), plus the
FusedGemm nodes' tuned cuBLASLt attributes. Answers: where does the tuned package's
time differ from the default's?

Usage (device, onnxruntime-gpu on PYTHONPATH): python3 bench/profile_packages.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MASK = "bigbird:block=64,window=3,global=2,random=3,seed=0"


def main() -> None:
    import e2e_models
    import onnx
    from profile_e2e import kernel_breakdown

    from stofc.frontend import load_model
    from stofc.package.bench import device_binding, time_session
    from stofc.package.load import load
    from stofc.package.verify import make_inputs
    from stofc.pipeline import Instruments, compile_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    parser.add_argument("--work", default="/tmp/stofc-profpkg")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    src = work / "bert.onnx"
    if not src.exists():
        e2e_models.export_bert(src)
    pkgs = {
        "default": compile_model(src, MASK, gpu="auto", max_seq_len=2048,
                                 out_dir=work / "default", instruments=Instruments(progress=False)),
        "tuned": compile_model(src, MASK, gpu="auto", max_seq_len=2048, out_dir=work / "tuned",
                               tune=True, batch=args.batch,
                               tune_options={"batch": args.batch, "seq_lens": (args.seq_len,),
                                             "db": work / "t.sqlite"},
                               instruments=Instruments(progress=False)),
    }
    graph = load_model(src)
    feeds, _ = make_inputs(graph, args.batch, args.seq_len, np.random.default_rng(0))
    res: dict = {"mask": MASK, "B": args.batch, "L": args.seq_len, "packages": {}}
    for name, pkg in pkgs.items():
        model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
        ranks = [(n.name, {a.name: list(a.ints) for a in n.attribute
                           if a.name.startswith("lt_algo")})
                 for n in model.graph.node if n.op_type == "FusedGemm"]
        doc = json.loads((pkg / "plan.json").read_text())
        sess = load(pkg, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        med, p10, p90 = time_session(sess, feeds, warmup=10, repeat=50)
        binding = device_binding(sess, feeds)
        sess.run_with_iobinding(binding)
        res["packages"][name] = {
            "median_ms": med, "p10": p10, "p90": p90,
            "lt_ranks": [r for r in ranks if r[1]][:12],
            "attention": {"config": doc["attention"][0]["config"],
                          "variants": doc["attention"][0]["variants"]},
            "profile": kernel_breakdown(lambda s=sess, b=binding: s.run_with_iobinding(b))}
        print(name, json.dumps(res["packages"][name])[:4000], flush=True)
        (out / "profile-packages.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
