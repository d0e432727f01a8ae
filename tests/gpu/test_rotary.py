"""The Rotary op on the GPU: its kernel against numpy, its CUDA twin against its CPU twin, and
the RoPE fixtures' packages on ONNX Runtime's CUDA EP.

* The kernel (``rope/rotary.cu.j2``, launched through CuPy with
  :func:`stofc.kernels.rotary.rotary_launch`'s arguments) against
  :func:`stofc.kernels.rotary.rotary_reference` on the element type's inputs: within two
  roundings of the element type, V and the unrotated tail bit for bit; a position outside
  the cache gives NaN for that token's rotated elements only.
* The CUDA twin in ONNX Runtime (skipped without onnxruntime's CUDAExecutionProvider)
  against the CPU twin: within one rounding of the element type (both compute ``x*c + r*s``
  as float products and one float sum, then round once), for every form, partial rotary,
  grouped-query heads, packed and separate inputs, table layouts and position ids.
* The RoPE fixtures compiled for this GPU: ``stofc verify`` on the CUDA EP against the
  original, every Rotary and SparseAttention node placed on the CUDA EP.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from stofc.kernels.attention.reference import from_bf16_bits
from stofc.kernels.render import render_kernel
from stofc.kernels.rotary import (
    ARGUMENTS,
    RotaryConfig,
    RotaryProblem,
    rotary_kernel,
    rotary_launch,
    rotary_reference,
)
from stofc.lower.emit import KERNEL_ABI
from tests.gpu.test_attention_helpers import quantise

ROOT = Path(__file__).resolve().parents[2]
ULP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
I64 = {"q_sb", "q_ss", "k_sb", "k_ss", "v_sb", "v_ss", "t_sb", "pos_sb"}

# dtype, H, Hkv, D, rotary_dim, interleaved, packed, table ("s": [S, W], "1": [1, S, W],
# "b": [B, S, W], "ids": a cache + [B, S] ids, "ids1": + [1, S], "off": + an offset), half
CASES = [
    ("float16", 12, 12, 64, 64, False, True, "s", False),      # ModernBERT-base
    ("bfloat16", 32, 8, 128, 128, False, False, "1", False),   # Llama-3-8B
    ("float16", 32, 8, 128, 128, False, True, "b", False),
    ("bfloat16", 32, 32, 96, 48, False, True, "s", False),     # Phi-3 style partial
    ("float16", 16, 16, 256, 64, True, False, "s", False),     # GPT-J: interleaved, partial
    ("float16", 8, 2, 128, 128, False, False, "ids", True),    # ORT contrib: half cache + ids
    ("bfloat16", 8, 8, 64, 32, True, True, "ids1", True),
    ("float16", 4, 4, 80, 80, False, True, "off", True),
    ("float16", 4, 1, 30, 10, False, False, "s", False),       # vector width 1
]


def _tables(rng, kind, B, S, W, rows=None):
    pos = None
    if kind in ("ids", "ids1", "off"):
        rows = rows or 3 * S
        shape = (rows, W)
        pos = {"ids": lambda: rng.integers(0, rows, (B, S)),
               "ids1": lambda: rng.integers(0, rows, (1, S)),
               "off": lambda: np.array([rows - S])}[kind]().astype(np.int64)
    else:
        shape = {"s": (S, W), "1": (1, S, W), "b": (B, S, W)}[kind]
    angles = rng.uniform(-20, 20, shape)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32), pos


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-h{c[1]}/{c[2]}-d{c[3]}r{c[4]}-"
                                             f"{'il' if c[5] else 'rh'}-{c[7]}" for c in CASES])
def test_rotary_kernel_matches_numpy(case):
    import cupy as cp

    from stofc.compile import compile_source
    from stofc.runtime.module import device_arch, load_kernel

    dtype, h, hkv, d, rd, il, packed, kind, half = case
    problem = RotaryProblem(dtype, d, rd, il)
    config = RotaryConfig(128)
    kernel = load_kernel(compile_source(render_kernel(rotary_kernel(problem, config),
                                                      (device_arch(),)).source, device_arch()),
                         rotary_kernel(problem, config).name)
    rng = np.random.default_rng(7)
    for B, S in ((1, 1), (2, 77), (3, 512)):
        cos, sin, pos = _tables(rng, kind, B, S, rd // 2 if half else rd)
        widths = ((h + 2 * hkv) * d,) if packed else (h * d, hkv * d, hkv * d)
        host = [quantise(rng.standard_normal((B, S, w)).astype(np.float32), dtype) for w in widths]
        dev = [cp.asarray(x) for x, _ in host]
        out = cp.full((B, S, (h + 2 * hkv) * d), 0xFFFF if dtype == "bfloat16" else np.nan,
                      np.uint16 if dtype == "bfloat16" else np.float16)
        launch = rotary_launch(problem, config, batch=B, seq=S, heads=h, kv_heads=hkv,
                               packed=packed, table_shape=cos.shape,
                               position_shape=None if pos is None else pos.shape)
        q = dev[0]
        ptrs = {"q": q, "out": out, "cos": cp.asarray(cos), "sin": cp.asarray(sin),
                "pos": cp.asarray(pos if pos is not None else np.zeros(1, np.int64))}
        if packed:   # k and v inside q: views starting at their offsets (the raw pointers)
            ptrs["k"], ptrs["v"] = q[..., launch.k_offset:], q[..., launch.v_offset:]
        else:
            ptrs["k"], ptrs["v"] = dev[1], dev[2]
        args = tuple(ptrs[n] if n in ptrs else
                     (np.int64 if n in I64 else np.int32)(launch.scalar(n)) for n in ARGUMENTS)
        kernel.launch(launch.grid, launch.threads, args)
        cp.cuda.runtime.deviceSynchronize()
        got = out.get()
        got = from_bf16_bits(got).astype(np.float64) if dtype == "bfloat16" else \
            got.astype(np.float64)
        vals = [v for _, v in host]
        want = rotary_reference(vals[0], None if packed else vals[1], None if packed else vals[2],
                                cos, sin, num_heads=h, kv_heads=hkv, head_dim=d, rotary_dim=rd,
                                interleaved=il, position_ids=pos)
        assert np.abs(got - want).max() <= 2 * ULP[dtype] * np.abs(want).max(), (B, S)
        v_at = (h + hkv) * d
        assert np.array_equal(got[..., v_at:], want[..., v_at:])


def test_a_position_outside_the_cache_gives_nan_for_that_token_only():
    import cupy as cp

    from stofc.compile import compile_source
    from stofc.runtime.module import device_arch, load_kernel

    problem, config = RotaryProblem("float16", 64, 64, False), RotaryConfig(64)
    inst = rotary_kernel(problem, config)
    kernel = load_kernel(compile_source(render_kernel(inst, (device_arch(),)).source,
                                        device_arch()), inst.name)
    B, S, h, rows = 1, 4, 2, 8
    q = cp.asarray(np.ones((B, S, (h + 2 * h) * 64), np.float16))
    out = cp.zeros_like(q)
    pos = cp.asarray(np.array([[0, 7, 8, -1]], np.int64))
    tables = cp.asarray(np.ones((rows, 64), np.float32))
    launch = rotary_launch(problem, config, batch=B, seq=S, heads=h, kv_heads=h, packed=True,
                           table_shape=(rows, 64), position_shape=(1, S))
    ptrs = {"q": q, "k": q[..., launch.k_offset:], "v": q[..., launch.v_offset:],
            "out": out, "cos": tables, "sin": tables, "pos": pos}
    args = tuple(ptrs[n] if n in ptrs else (np.int64 if n in I64 else np.int32)(launch.scalar(n))
                 for n in ARGUMENTS)
    kernel.launch(launch.grid, launch.threads, args)
    got = out.get().astype(np.float32)
    rotated = got[0, :, :2 * h * 64]
    assert np.isfinite(rotated[:2]).all() and np.isnan(rotated[2:]).all()
    assert np.isfinite(got[0, :, 2 * h * 64:]).all()   # V copied whatever the position


# ---------------------------------------------------------------- the CUDA twin in ORT
ort = pytest.importorskip("onnxruntime")
HAS_CUDA_EP = "CUDAExecutionProvider" in ort.get_available_providers()
needs_cuda_ep = pytest.mark.skipif(not HAS_CUDA_EP,
                                   reason="onnxruntime has no CUDAExecutionProvider")


def _twin_model(tmp_path, arch, case):
    from tests.gpu.test_ort_cuda import write_kernel

    dtype, h, hkv, d, rd, il, packed, kind, _ = case
    inst = rotary_kernel(RotaryProblem(dtype, d, rd, il))
    rel = write_kernel(tmp_path, render_kernel(inst, (arch,)).source, arch)
    elem = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}[dtype]
    names = ["q", "", ""] if packed else ["q", "k", "v"]
    nodes = [helper.make_node("Cast", [n], [f"{n}t"], to=elem) for n in names if n]
    ins = [f"{n}t" if n else "" for n in names] + ["cos", "sin"]
    ins += ["pos"] if kind in ("ids", "ids1", "off") else []
    nodes.append(helper.make_node("Rotary", ins, ["yt"], domain="ai.stofc", num_heads=h,
                                  kv_num_heads=hkv, head_dim=d, rotary_dim=rd,
                                  interleaved=int(il), kernel=f"{rel}:{inst.name}",
                                  kernel_abi=KERNEL_ABI))
    nodes.append(helper.make_node("Cast", ["yt"], ["y"], to=TensorProto.FLOAT))
    vi = helper.make_tensor_value_info
    inputs = [vi(n, TensorProto.FLOAT, None) for n in names if n]
    inputs += [vi("cos", TensorProto.FLOAT, None), vi("sin", TensorProto.FLOAT, None)]
    if "pos" in ins:
        inputs.append(vi("pos", TensorProto.INT64, None))
    graph = helper.make_graph(nodes, "rotary", inputs, [vi("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.stofc", 1)])
    model.ir_version = 8
    return model


@needs_cuda_ep
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-h{c[1]}/{c[2]}-d{c[3]}r{c[4]}-"
                                             f"{'il' if c[5] else 'rh'}-{c[7]}" for c in CASES])
def test_rotary_cuda_twin_matches_cpu_twin(tmp_path, case):
    from stofc.package.ortlib import build_library
    from stofc.runtime.module import device_arch
    from tests.gpu.test_ort_cuda import sessions

    lib = build_library(tmp_path / "lib")
    dtype, h, hkv, d, rd, _il, packed, kind, half = case
    cuda, cpu = sessions(_twin_model(tmp_path, device_arch(), case), tmp_path, lib)
    rng = np.random.default_rng(11)
    for B, S in ((1, 1), (2, 77), (4, 256), (2, 77)):
        cos, sin, pos = _tables(rng, kind, B, S, rd // 2 if half else rd)
        widths = ((h + 2 * hkv) * d,) if packed else (h * d, hkv * d, hkv * d)
        feeds = {n: rng.standard_normal((B, S, w)).astype(np.float32)
                 for n, w in zip("qkv", widths, strict=False)}
        feeds |= {"cos": cos, "sin": sin} | ({"pos": pos} if pos is not None else {})
        (got,) = cuda.run(None, feeds)
        (want,) = cpu.run(None, feeds)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= ULP[dtype] * scale, (B, S)


# ---------------------------------------------------------------- the fixtures' packages
FIXTURES = [("llama_ts_op17", "fp16"), ("llama_dynamo_op18", "bf16"),
            ("mistral_optimum_op18", "fp16"), ("qwen2_dynamo_op18", "fp16"),
            ("phi3_ts_op17", "fp16"), ("gemma2_ts_op17_eager", "fp16"),
            ("gemma3_optimum_op18", "fp16"), ("modernbert_ts_op17", "fp16"),
            ("modernbert_dynamo_op18", "bf16")]


@needs_cuda_ep
@pytest.mark.parametrize("fixture,dtype", FIXTURES)
def test_rope_fixture_package_on_cuda_matches_the_original(tmp_path, fixture, dtype):
    from stofc.frontend import load_model
    from stofc.package.load import load
    from stofc.package.verify import make_inputs, verify_package
    from stofc.pipeline import Instruments, compile_model
    from stofc.targets import detect

    model = ROOT / "tests" / "fixtures" / f"{fixture}.onnx"
    pkg = compile_model(model, "model", gpu=detect().name, dtype=dtype, max_seq_len=64,
                        out_dir=tmp_path / "pkg", instruments=Instruments(progress=False))
    report = verify_package(pkg, model=model, provider="cuda", cases=[(2, 64), (1, 17)])
    assert report.passed, report.to_dict()

    def profiled(so):
        so.enable_profiling = True
        so.profile_file_prefix = str(tmp_path / "prof")

    cuda = load(pkg, providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
                session_options_hook=profiled)
    feeds, _ = make_inputs(load_model(model), 2, 64, np.random.default_rng(0))
    cuda.run(None, feeds)
    events = json.loads(Path(cuda.end_profiling()).read_text())
    placed: dict[str, set] = {}
    for e in events:
        op = e.get("args", {}).get("op_name")
        if op in ("Rotary", "SparseAttention"):
            placed.setdefault(op, set()).add(e["args"].get("provider"))
    assert placed == {"Rotary": {"CUDAExecutionProvider"},
                      "SparseAttention": {"CUDAExecutionProvider"}}, placed
