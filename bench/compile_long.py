"""Time and peak RSS of ``stofc compile`` at long max_seq_len (issue 18, part 2). CPU only.

Each length compiles in its own child process (``/usr/bin/time``-free: the child reports
its own ``ru_maxrss``), so one length's peak does not hide another's::

    PYTHONPATH=. python bench/compile_long.py MODEL.onnx 8192 16384 32768 [--mask SPEC]

A BERT-base-like export with 32768 positions (random weights; needs torch and
transformers, e.g. the fixture venv)::

    python - <<'EOF'
    import torch, transformers as tf
    cfg = tf.BertConfig(num_hidden_layers=2, max_position_embeddings=32768)
    m = tf.BertModel(cfg, add_pooling_layer=False).eval()
    ids, am = torch.randint(2, 1000, (2, 16)), torch.ones(2, 16, dtype=torch.long)
    torch.onnx.export(m, (ids, am), "bert32k.onnx", dynamo=False, opset_version=17,
                      input_names=["input_ids", "attention_mask"],
                      dynamic_axes={"input_ids": {0: "b", 1: "s"},
                                    "attention_mask": {0: "b", 1: "s"}})
    EOF
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

CHILD = textwrap.dedent("""
    import json, resource, sys, time
    from stofc.pipeline import Instruments, compile_model
    model, length, mask, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    ins = Instruments(progress=False)
    start = time.perf_counter()
    compile_model(model, mask, max_seq_len=length, out_dir=out, instruments=ins)
    print(json.dumps({"seconds": time.perf_counter() - start,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "stages": {name: round(s, 3) for name, s in ins.timings}}))
""")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("lengths", type=int, nargs="+")
    ap.add_argument("--mask", default="model")
    args = ap.parse_args()
    for length in args.lengths:
        with tempfile.TemporaryDirectory() as tmp:
            done = subprocess.run([sys.executable, "-c", CHILD, args.model, str(length),
                                   args.mask, str(Path(tmp) / "pkg")],
                                  capture_output=True, text=True)
        if done.returncode:
            print(f"L={length}: failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        masks = r["stages"].get("read the model's masks", 0.0)
        print(f"L={length:>6}: {r['seconds']:7.1f} s, peak RSS {r['peak_rss_mib']:8.0f} MiB "
              f"(reading the model's masks {masks:.1f} s)")


if __name__ == "__main__":
    main()
