"""Time RoPE as stofc runs it (the ai.stofc Rotary op) against the ONNX ops it replaced.

Per shape (ModernBERT-base, Llama-3-8B, Phi-3-mini, GPT-NeoX-20B's partial rotary; a long
and a batched point each), on the GPU present:

* ``kernel``: the rotary kernel alone (``rope/rotary.cu.j2`` through CuPy, CUDA events over
  ``--repeat`` launches), with the bandwidth it reaches (one read of Q|K|V and the tables'
  rows, one write of ``[Q' | K' | V]``);
* ``Rotary``: the op in ONNX Runtime's CUDA EP (IOBinding, device-resident inputs): what a
  package runs per layer;
* ``onnx fp16`` / ``onnx fp32``: the same function as the ONNX ops a package ran before
  (split of the packed projection, head split, Transpose, Slice, Neg, Concat, Mul, Add, the
  Transpose and Reshape back to ``[B, S, H*D]`` SparseAttention read), in float16, and in
  float32 between Casts as packages of float32 exports had it;
* the largest difference between the op's output and the ONNX ops' (fp32), relative.

Usage (device machine, repo root, onnxruntime-gpu installed: ``source bench/ort_env.sh``):
``python3 bench/rotary.py --out $OUT`` writes ``rotary-<gpu>-<date>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stofc.compile import compile_source
from stofc.kernels.render import render_kernel
from stofc.kernels.rotary import (
    ARGUMENTS,
    RotaryConfig,
    RotaryProblem,
    rotary_kernel,
    rotary_launch,
)

# name, H, Hkv, D, rotary_dim, (batch, seq) points
SHAPES = [("modernbert-base", 12, 12, 64, 64, ((1, 8192), (8, 512))),
          ("llama-3-8b", 32, 8, 128, 128, ((1, 8192), (4, 2048))),
          ("phi-3-mini", 32, 32, 96, 96, ((1, 4096), (8, 512))),
          ("gpt-neox-20b", 64, 64, 96, 24, ((1, 2048), (8, 512)))]
I64 = {"q_sb", "q_ss", "k_sb", "k_ss", "v_sb", "v_ss", "t_sb", "pos_sb"}
CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"


def _onnx_rope(h: int, hkv: int, d: int, rd: int, fp32: bool) -> onnx.ModelProto:
    """The decomposed rotation a package ran before the Rotary op (module doc)."""
    nodes, inits = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value, np.int64), name))
        return name

    def node(op, ins, out, **attrs):
        nodes.append(helper.make_node(op, ins, [out], **attrs))
        return out

    qkv = node("Cast", ["qkv"], "qkv_f", to=TensorProto.FLOAT) if fp32 else "qkv"
    nodes.append(helper.make_node("Split", [qkv, const("sizes", [h * d, hkv * d, hkv * d])],
                                  ["q", "k", "v"], axis=-1))
    tables = []
    for t in ("cos", "sin"):
        x = t if fp32 else node("Cast", [t], f"{t}16", to=TensorProto.FLOAT16)
        tables.append(node("Unsqueeze", [x, const(f"{t}_ax", [0, 1])], f"{t}4"))
    outs = []
    for name, heads in (("q", h), ("k", hkv)):
        x = node("Transpose", [node("Reshape", [name, const(f"{name}_split", [0, 0, heads, d])],
                                    f"{name}_s")], f"{name}_h", perm=[0, 2, 1, 3])
        part = node("Slice", [x, const(f"{name}_0", [0]), const(f"{name}_rd", [rd]),
                              const(f"{name}_a", [3])], f"{name}_p") if rd < d else x
        x1 = node("Slice", [part, const(f"{name}_z", [0]), const(f"{name}_h2", [rd // 2]),
                            const(f"{name}_a1", [3])], f"{name}_x1")
        x2 = node("Slice", [part, const(f"{name}_h3", [rd // 2]), const(f"{name}_e", [rd]),
                            const(f"{name}_a2", [3])], f"{name}_x2")
        rot = node("Concat", [node("Neg", [x2], f"{name}_n"), x1], f"{name}_r", axis=-1)
        y = node("Add", [node("Mul", [part, tables[0]], f"{name}_c"),
                         node("Mul", [rot, tables[1]], f"{name}_sn")], f"{name}_y")
        if rd < d:
            rest = node("Slice", [x, const(f"{name}_rd2", [rd]), const(f"{name}_d", [d]),
                                  const(f"{name}_a3", [3])], f"{name}_rest")
            y = node("Concat", [y, rest], f"{name}_cat", axis=-1)
        flat = node("Reshape", [node("Transpose", [y], f"{name}_t", perm=[0, 2, 1, 3]),
                                const(f"{name}_flat", [0, 0, -1])], f"{name}_f")
        outs.append(node("Cast", [flat], f"{name}_out", to=TensorProto.FLOAT16) if fp32 else flat)
    outs.append(node("Cast", ["v"], "v_out", to=TensorProto.FLOAT16) if fp32 else
                node("Identity", ["v"], "v_out"))
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, "onnx_rope", [vi("qkv", TensorProto.FLOAT16, ["B", "S", (h + 2 * hkv) * d]),
                             vi("cos", TensorProto.FLOAT, ["S", rd]),
                             vi("sin", TensorProto.FLOAT, ["S", rd])],
        [vi(o, TensorProto.FLOAT16, None) for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _rotary_model(h, hkv, d, rd, kernel_ref: str) -> onnx.ModelProto:
    vi = helper.make_tensor_value_info
    node = helper.make_node("Rotary", ["qkv", "", "", "cos", "sin"], ["out"], domain="ai.stofc",
                            num_heads=h, kv_num_heads=hkv, head_dim=d, rotary_dim=rd,
                            kernel=kernel_ref, kernel_abi=3)
    graph = helper.make_graph([node], "rotary",
                              [vi("qkv", TensorProto.FLOAT16, ["B", "S", (h + 2 * hkv) * d]),
                               vi("cos", TensorProto.FLOAT, ["S", rd]),
                               vi("sin", TensorProto.FLOAT, ["S", rd])],
                              [vi("out", TensorProto.FLOAT16, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.stofc", 1)])
    model.ir_version = 8
    return model


def _kernel_us(inst, arch, problem, config, B, S, h, hkv, d, rd, repeat) -> float:
    import cupy as cp

    from stofc.runtime.module import load_kernel

    kernel = load_kernel(compile_source(render_kernel(inst, (arch,)).source, arch), inst.name)
    qkv = cp.asarray(np.random.default_rng(0).standard_normal((B, S, (h + 2 * hkv) * d))
                     .astype(np.float16))
    out = cp.empty_like(qkv)
    tables = cp.asarray(np.ones((S, rd), np.float32))
    launch = rotary_launch(problem, config, batch=B, seq=S, heads=h, kv_heads=hkv, packed=True,
                           table_shape=(S, rd))
    ptrs = {"q": qkv, "k": qkv[..., launch.k_offset:], "v": qkv[..., launch.v_offset:],
            "out": out, "cos": tables, "sin": tables, "pos": tables}
    args = tuple(ptrs[n] if n in ptrs else (np.int64 if n in I64 else np.int32)(launch.scalar(n))
                 for n in ARGUMENTS)
    for _ in range(5):
        kernel.launch(launch.grid, launch.threads, args)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(repeat):
        kernel.launch(launch.grid, launch.threads, args)
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1e3 / repeat


def main() -> None:
    import onnxruntime as ort

    from stofc.package.bench import time_session
    from stofc.package.ortlib import build_library
    from stofc.runtime.module import device_arch
    from stofc.targets import detect

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/out"))
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "rotary-work"
    (work / "kernels").mkdir(parents=True, exist_ok=True)
    lib = build_library(work / "lib")
    arch, gpu = device_arch(), detect()
    rows = []
    for name, h, hkv, d, rd, points in SHAPES:
        problem, config = RotaryProblem("float16", d, rd, False), RotaryConfig()
        inst = rotary_kernel(problem, config)
        compiled = compile_source(render_kernel(inst, (arch,)).source, arch)
        rel = f"kernels/{inst.name}.{arch}.cubin"
        (work / rel).write_bytes(compiled.binary)
        so = ort.SessionOptions()
        so.add_session_config_entry("stofc.package_dir", str(work))
        so.register_custom_ops_library(str(lib))
        op = ort.InferenceSession(_rotary_model(h, hkv, d, rd, f"{rel}:{inst.name}")
                                  .SerializeToString(), so, providers=[CUDA, CPU])
        base = {fp32: ort.InferenceSession(_onnx_rope(h, hkv, d, rd, fp32).SerializeToString(),
                                           providers=[CUDA, CPU]) for fp32 in (False, True)}
        for B, S in points:
            rng = np.random.default_rng(1)
            angles = rng.uniform(-50, 50, (S, rd))
            feeds = {"qkv": rng.standard_normal((B, S, (h + 2 * hkv) * d)).astype(np.float16),
                     "cos": np.cos(angles).astype(np.float32),
                     "sin": np.sin(angles).astype(np.float32)}
            (got,) = op.run(None, feeds)
            want = np.concatenate(base[True].run(None, feeds), axis=-1).astype(np.float32)
            diff = float(np.abs(got.astype(np.float32) - want).max() / np.abs(want).max())
            us = _kernel_us(inst, arch, problem, config, B, S, h, hkv, d, rd, args.repeat)
            moved = 2 * B * S * (h + 2 * hkv) * d * 2 + 2 * S * rd * 4
            row = {"shape": name, "B": B, "S": S, "H": h, "Hkv": hkv, "D": d, "rotary_dim": rd,
                   "kernel_us": us, "kernel_gbs": moved / us / 1e3,
                   "rotary_ms": time_session(op, feeds, warmup=10, repeat=50)[0],
                   "onnx_fp16_ms": time_session(base[False], feeds, warmup=10, repeat=50)[0],
                   "onnx_fp32_ms": time_session(base[True], feeds, warmup=10, repeat=50)[0],
                   "max_rel_diff": diff}
            rows.append(row)
            print(json.dumps(row), flush=True)
    stem = f"rotary-{gpu.name}-{dt.date.today().isoformat()}"
    (args.out / f"{stem}.json").write_text(json.dumps({"gpu": gpu.name, "rows": rows}, indent=1))
    lines = [f"# RoPE: the Rotary op vs the ONNX ops it replaced ({gpu.name})", "",
             "| shape | B x S | kernel us | GB/s | Rotary (ORT) ms | ONNX fp16 ms | "
             "ONNX fp32 ms | speed-up vs fp32 | max rel diff |", "|---" * 9 + "|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['B']} x {r['S']} | {r['kernel_us']:.1f} | "
                     f"{r['kernel_gbs']:.0f} | {r['rotary_ms']:.3f} | {r['onnx_fp16_ms']:.3f} | "
                     f"{r['onnx_fp32_ms']:.3f} | {r['onnx_fp32_ms'] / r['rotary_ms']:.1f}x | "
                     f"{r['max_rel_diff']:.1e} |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
