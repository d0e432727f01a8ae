"""End to end on the GPU, in one run: stofc packages vs what a user could pick instead.

Model: Hugging Face BERT-base (random weights from the config, eager attention so
ONNX Runtime's optimizer can fuse it, max_position_embeddings 2048) exported with
``torch.onnx.export`` (TorchScript, opset 17), exactly like
``shared/bench/anchors_ort_bert.py``. For each mask (BigBird, Longformer, causal):

- stofc: ``compile_model`` -> package, ``verify_package`` on the CUDA EP, then timed
  with IOBinding (``stofc.package.bench.time_session``);
- ORT optimized: the same export through ``onnxruntime.transformers.optimizer``,
  fp16, CUDA EP, IOBinding. A structured mask can only reach it as a dense bias, so
  its time is the dense-attention cost whatever the mask (timed once per shape);
- torch.compile + FlexAttention: the anchors' own 12-layer encoder
  (``shared/bench/anchors_mha.py``'s ``Encoder``, mirrored here) with a block mask
  built from stofc's own dense mask, so both compute the same function.

Median ms; results as JSON + a markdown table under ``--out``. A deadline guard
skips what no longer fits and says so.

Usage (device, with onnxruntime-gpu on PYTHONPATH): python3 bench/e2e.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MASKS = {
    "bigbird": "bigbird:block=64,window=3,global=2,random=3,seed=0",
    "longformer": "longformer:window=128,global=32",
    "causal": "causal",
}
CASES = {"bigbird": [(1, 128), (8, 512), (4, 2048)], "longformer": [(4, 2048)],
         "causal": [(4, 2048)]}
T0 = time.time()


def left(deadline: float) -> float:
    return deadline - (time.time() - T0)


def export_bert(path: Path) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.BertConfig(max_position_embeddings=2048)
    cfg._attn_implementation = "eager"
    model = tf.BertModel(cfg, add_pooling_layer=False).eval()

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    ids = torch.randint(0, 30000, (2, 128))
    am = torch.ones(2, 128, dtype=torch.long)
    torch.onnx.export(Wrap(model), (ids, am), str(path), input_names=["input_ids", "attention_mask"],
                      output_names=["last_hidden_state"],
                      dynamic_axes={"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "s"},
                                    "last_hidden_state": {0: "b", 1: "s"}},
                      opset_version=17, dynamo=False)


def flex_encoder():
    """The anchors' encoder (shared/bench/anchors_mha.py), FlexAttention inside."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    class Encoder(torch.nn.Module):
        def __init__(self, layers=12, hidden=768, heads=12, ffn=3072):
            super().__init__()
            self.heads = heads
            lin = torch.nn.Linear
            self.qkv = torch.nn.ModuleList(lin(hidden, 3 * hidden) for _ in range(layers))
            self.o = torch.nn.ModuleList(lin(hidden, hidden) for _ in range(layers))
            self.f1 = torch.nn.ModuleList(lin(hidden, ffn) for _ in range(layers))
            self.f2 = torch.nn.ModuleList(lin(ffn, hidden) for _ in range(layers))
            self.ln1 = torch.nn.ModuleList(torch.nn.LayerNorm(hidden) for _ in range(layers))
            self.ln2 = torch.nn.ModuleList(torch.nn.LayerNorm(hidden) for _ in range(layers))

        def forward(self, x, block_mask):
            b, s, h = x.shape
            for i in range(len(self.qkv)):
                q, k, v = self.qkv[i](x).view(b, s, 3, self.heads, h // self.heads).permute(
                    2, 0, 3, 1, 4)
                a = flex_attention(q, k, v, block_mask=block_mask)
                x = self.ln1[i](x + self.o[i](a.transpose(1, 2).reshape(b, s, h)))
                x = self.ln2[i](x + self.f2[i](torch.nn.functional.gelu(self.f1[i](x))))
            return x

    return Encoder


def time_flex(dense: np.ndarray, batch: int, seq: int) -> tuple[float, float]:
    """(median ms, compile s) of torch.compile(Encoder with FlexAttention) on ``dense``."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    from triton.testing import do_bench

    torch._dynamo.reset()
    allowed = torch.from_numpy(np.ascontiguousarray(dense[:seq, :seq])).cuda()

    def mask_mod(b, h, q, k):
        return allowed[q, k]

    enc = flex_encoder()().cuda().half().eval()
    comp = torch.compile(enc, dynamic=False)
    bm = create_block_mask(mask_mod, None, None, seq, seq, device="cuda")
    x = torch.randn(batch, seq, 768, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        t = time.time()
        comp(x, bm)
        torch.cuda.synchronize()
        compile_s = time.time() - t
        ms = do_bench(lambda: comp(x, bm), warmup=10, rep=50, return_mode="median")
    return ms, compile_s


def main() -> None:
    import onnxruntime as ort

    from stofc.frontend import load_model
    from stofc.masks import encode, parse_mask
    from stofc.package.bench import optimized_baseline, time_session
    from stofc.package.load import load
    from stofc.package.verify import make_inputs, verify_package
    from stofc.pipeline import Instruments, compile_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--deadline", type=float, default=540.0)
    parser.add_argument("--work", default="/tmp/stofc-e2e")
    args = parser.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def emit(**row):
        row["t"] = round(time.time() - T0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "e2e.jsonl").open("a").write(json.dumps(row) + "\n")

    src = work / "bert.onnx"
    export_bert(src)
    emit(step="export", model="bert-base (HF config, eager attention)")
    graph = load_model(src)
    rng = np.random.default_rng(0)
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    base = ort.InferenceSession(str(optimized_baseline(graph, src, work)), providers=providers)
    shapes = sorted({c for cs in CASES.values() for c in cs})
    feeds = {c: make_inputs(graph, *c, rng)[0] for c in shapes}
    for b, s in shapes:
        med, _, _ = time_session(base, feeds[(b, s)], warmup=10, repeat=50)
        emit(impl="ort_optimized_fp16_dense", B=b, S=s, ms=med)
    for name, spec in MASKS.items():
        if left(args.deadline) < 60:
            emit(step="skip", mask=name, why="deadline")
            continue
        pkg = compile_model(src, spec, gpu="auto", max_seq_len=2048, out_dir=work / f"pkg-{name}",
                            instruments=Instruments(progress=False))
        report = verify_package(pkg, model=src, provider="cuda", cases=[(2, 512)])
        emit(step="verify", mask=name, passed=report.passed, report=report.to_dict())
        session = load(pkg, providers=providers)
        dense = None
        for b, s in CASES[name]:
            med, _, _ = time_session(session, feeds[(b, s)], warmup=10, repeat=50)
            emit(impl="stofc", mask=name, B=b, S=s, ms=med)
            if left(args.deadline) < 90:
                emit(step="skip", impl="flex", mask=name, B=b, S=s, why="deadline")
                continue
            if dense is None:
                dense = encode(parse_mask(spec), 2048, num_heads=12).to_dense(0)
            try:
                ms, compile_s = time_flex(dense, b, s)
                emit(impl="torch_compile_flex", mask=name, B=b, S=s, ms=ms, compile_s=compile_s)
            except Exception as err:  # report and go on: the other figures still count
                emit(impl="torch_compile_flex", mask=name, B=b, S=s, err=repr(err)[:300])
    write_table(rows, out)


def write_table(rows: list[dict], out: Path) -> None:
    ort_ms = {(r["B"], r["S"]): r["ms"] for r in rows if r.get("impl") == "ort_optimized_fp16_dense"}
    flex = {(r["mask"], r["B"], r["S"]): r.get("ms") for r in rows
            if r.get("impl") == "torch_compile_flex"}
    lines = ["| mask | B | L | stofc ms | ORT optimized ms | torch.compile+Flex ms | vs ORT | vs Flex |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.get("impl") != "stofc":
            continue
        key = (r["B"], r["S"])
        o, f = ort_ms.get(key), flex.get((r["mask"], *key))
        ms = r["ms"]
        flex_ms = f"{f:.3f}" if f else "-"
        vs_flex = f"{f / ms:.2f}x" if f else "-"
        lines.append(f"| {r['mask']} | {r['B']} | {r['S']} | {ms:.3f} | {o:.3f} | {flex_ms} | "
                     f"{o / ms:.2f}x | {vs_flex} |")
    text = "\n".join(lines)
    print(text)
    (out / "e2e-table.md").write_text(text + "\n")
    (out / "e2e.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
