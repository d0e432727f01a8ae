"""The CUDA twins of the ai.stofc ops in ONNX Runtime's CUDA EP, against the CPU twins.

Skipped unless a CUDA device and onnxruntime's CUDAExecutionProvider both exist
(tests/gpu/conftest.py skips everything here without a device). Single-op models
check each twin's launch (attention: block-wise, gathered, residue-permuted and
row-wise plans, with and without key padding and bias; FusedGemm: every
activation / bias / residual combination through cuBLASLt + the epilogue kernel;
AddLayerNorm: every residual / norm / beta / sum combination) against the CPU twin
on the same inputs; package tests compile the example model with several masks
and compare the CUDA EP with the CPU EP run and with the original model
(``stofc verify``), check that every stofc node ran on the CUDA EP, that a second
run and an IOBinding run give the same result, and that a CUDA graph capture
replays correctly.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ort = pytest.importorskip("onnxruntime")
if "CUDAExecutionProvider" not in ort.get_available_providers():
    pytest.skip("onnxruntime has no CUDAExecutionProvider", allow_module_level=True)

from stofc.compile import compile_source  # noqa: E402
from stofc.kernels.attention import AttentionConfig, KernelSpec, compile_kernel  # noqa: E402
from stofc.kernels.attention.config import attention_family  # noqa: E402
from stofc.kernels.attention.launch import launch_data  # noqa: E402
from stofc.kernels.attention.ws_launch import with_lean_walk  # noqa: E402
from stofc.kernels.render import render_kernel  # noqa: E402
from stofc.kernels.vendor_gemm import split_fused_gemm  # noqa: E402
from stofc.lower.twins import (  # noqa: E402
    KERNEL_ABI,
    epilogue_kernel,
    launch_attributes,
    norm_epilogue,
)
from stofc.masks import encode  # noqa: E402
from stofc.package.maskbin import write_attention_plan, write_mask_binary  # noqa: E402
from stofc.package.ortlib import build_library  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
F16 = TensorProto.FLOAT16


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> Path:
    return build_library(tmp_path_factory.mktemp("lib"))


@pytest.fixture(scope="module")
def arch() -> str:
    from stofc.runtime.module import device_arch
    return device_arch()


def sessions(model: onnx.ModelProto, pkg: Path, lib: Path, **cuda_options):
    """(CUDA session, CPU session) of ``model`` with ``pkg`` as the package directory."""
    out = []
    for providers in ([(CUDA, cuda_options), CPU], [CPU]):
        so = ort.SessionOptions()
        so.add_session_config_entry("stofc.package_dir", str(pkg))
        so.register_custom_ops_library(str(lib))
        out.append(ort.InferenceSession(model.SerializeToString(), so, providers=providers))
    return out


def make_model(node: onnx.NodeProto, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph([node], "t", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.stofc", 1)])
    model.ir_version = 8
    return model


def write_kernel(pkg: Path, source, arch: str) -> str:
    """Compile ``source`` for this GPU into ``pkg/kernels``; returns the package path."""
    rel = f"kernels/{source.name}.{arch}.cubin"
    (pkg / "kernels").mkdir(exist_ok=True)
    (pkg / rel).write_bytes(compile_source(source, arch).binary)
    return rel


# ---------------------------------------------------------------- SparseAttention

ATTENTION = [
    ("bigbird:block=16,window=3,global=1,random=1,seed=0", 256,
     AttentionConfig("block", 64, 16, 4, 2, 1)),
    ("strided:stride=64", 512, AttentionConfig("block", 64, 16, 4, 3, 1, gather=True)),
    ("dilated:window=256,dilation=2", 1000, AttentionConfig("block", 64, 16, 2, 2, 2, permute=True)),
    ("sliding:window=96", 300, AttentionConfig("row", 64, 2, 4)),
]
H, D = 4, 64


def attention_model(pkg: Path, arch: str, spec: str, L: int, config: AttentionConfig, *,
                    kpm: bool, bias: bool, kv_heads: int = H, packed: bool = False,
                    **override) -> onnx.ModelProto:
    fmt = encode(spec, L)
    write_mask_binary(fmt, pkg / "mask.bin")
    write_attention_plan(launch_data(fmt, config), pkg / "attn.plan.bin")
    kspec = KernelSpec(config, "float16", D, has_bias=bias, has_key_bits=kpm)
    (pkg / "kernels").mkdir(exist_ok=True)
    rel = f"kernels/{kspec.name}.{arch}.cubin"
    (pkg / rel).write_bytes(compile_kernel(kspec, arch).binary)   # ws / wgmma: built for sm_90a
    launch = dict(attention_family(config.kind).launch(config, D))
    threads, per_row, smem = (launch[k] for k in ("block_threads", "blocks_per_tile_row",
                                                  "smem_bytes"))
    attrs = dict(num_heads=H, head_dim=D, mask_file="mask.bin", kernel=f"{rel}:{kspec.name}",
                 kernel_abi=KERNEL_ABI, launch_plan="attn.plan.bin", block_threads=threads,
                 blocks_per_tile_row=per_row, smem_bytes=smem)
    if kv_heads != H:
        attrs["kv_num_heads"] = kv_heads
    attrs.update(override)
    attrs = {k: v for k, v in attrs.items() if v is not None}
    names = ["qkv", "", ""] if packed else ["q", "k", "v"]
    names += ["kpm" if kpm else "", "bias" if bias else ""]
    while names[-1] == "":
        names.pop()
    node = helper.make_node("SparseAttention", names, ["out"], domain="ai.stofc", **attrs)
    if packed:
        inputs = [helper.make_tensor_value_info("qkv", F16, ["B", "S", (H + 2 * kv_heads) * D])]
    else:
        inputs = [helper.make_tensor_value_info(n, F16, ["B", "S", h * D])
                  for n, h in (("q", H), ("k", kv_heads), ("v", kv_heads))]
    if kpm:
        inputs.append(helper.make_tensor_value_info("kpm", TensorProto.INT64, ["B", "S"]))
    if bias:
        inputs.append(helper.make_tensor_value_info("bias", F16, [1, H, "S", "S"]))
    return make_model(node, inputs, [helper.make_tensor_value_info("out", F16, ["B", "S", H * D])])


def attention_feeds(rng, B: int, S: int, kpm: bool, bias: bool, *, kv_heads: int = H,
                    packed: bool = False) -> dict:
    feeds = {n: rng.standard_normal((B, S, h * D)).astype(np.float16)
             for n, h in (("q", H), ("k", kv_heads), ("v", kv_heads))}
    if packed:
        feeds = {"qkv": np.concatenate([feeds["q"], feeds["k"], feeds["v"]], axis=-1)}
    if kpm:
        mask = np.ones((B, S), np.int64)
        mask[1:, S - S // 3:] = 0          # right padding
        mask[-1, 5] = 0                    # and an interior hole (needs the key bits)
        feeds["kpm"] = mask
    if bias:
        feeds["bias"] = rng.standard_normal((1, H, S, S)).astype(np.float16)
    return feeds


@pytest.mark.parametrize("spec,L,config", ATTENTION, ids=[c.describe() for _, _, c in ATTENTION])
@pytest.mark.parametrize("kpm,bias", [(False, False), (True, False), (True, True)])
def test_sparse_attention_cuda_matches_cpu_twin(tmp_path, lib, arch, spec, L, config, kpm, bias):
    model = attention_model(tmp_path, arch, spec, L, config, kpm=kpm, bias=bias)
    cuda, cpu = sessions(model, tmp_path, lib)
    rng = np.random.default_rng(0)
    for B, S in ((1, L), (3, L - 37), (2, 70)):
        feeds = attention_feeds(rng, B, S, kpm, bias)
        got = cuda.run(None, feeds)[0].astype(np.float32)
        want = cpu.run(None, feeds)[0].astype(np.float32)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=f"B={B} S={S}")
        again = cuda.run(None, feeds)[0].astype(np.float32)
        assert np.array_equal(got, again)                   # uploads happen once, runs repeat


@pytest.mark.parametrize("override,message", [
    ({"kernel_abi": None}, "carries no CUDA launch attributes"),
    ({"launch_plan": "missing.plan.bin"}, "cannot be opened"),
    ({"block_threads": None}, "attribute 'block_threads' is required"),
])
def test_sparse_attention_bad_cuda_attributes_fail_at_session_creation(tmp_path, lib, arch,
                                                                      override, message):
    spec, L, config = ATTENTION[0]
    model = attention_model(tmp_path, arch, spec, L, config, kpm=False, bias=False, **override)
    with pytest.raises(Exception, match="stofc SparseAttention") as err:
        sessions(model, tmp_path, lib)
    assert message in str(err.value)


def test_sparse_attention_cuda_graph_capture(tmp_path, lib, arch):
    spec, L, config = ATTENTION[0]
    model = attention_model(tmp_path, arch, spec, L, config, kpm=True, bias=False)
    cuda, cpu = sessions(model, tmp_path, lib, enable_cuda_graph="1")
    rng = np.random.default_rng(1)
    feeds = attention_feeds(rng, 2, L, True, False)
    inputs = {n: ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0) for n, a in feeds.items()}
    out = ort.OrtValue.ortvalue_from_shape_and_type([2, L, H * D], np.float16, "cuda", 0)
    io = cuda.io_binding()
    for n, v in inputs.items():
        io.bind_ortvalue_input(n, v)
    io.bind_ortvalue_output("out", out)
    for step in range(4):             # plain run(s), capture, then replays on new data
        if step:
            feeds = attention_feeds(rng, 2, L, True, False)
            for n, a in feeds.items():
                inputs[n].update_inplace(a)
        cuda.run_with_iobinding(io)
        got = out.numpy().astype(np.float32)
        want = cpu.run(None, feeds)[0].astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=f"step {step}")


# ---------------------------------------------------------------- the warp-specialised kernel


@pytest.fixture(scope="module")
def hopper(arch) -> str:
    if arch != "sm_90":
        pytest.skip(f"the warp-specialised kernel is Hopper-only (sm_90a); this GPU is {arch}")
    return arch


def ws_config(**kw) -> AttentionConfig:
    return AttentionConfig("ws", 64, 16, kw.pop("warps", 12), kw.pop("stages", 2), 1,
                           mma="wgmma", **kw)


def lean_config(spec: str, L: int, **kw) -> AttentionConfig:
    """``ws_config(**kw)`` with the lean walk its plan on ``spec`` at ``L`` has (head_dim 64)."""
    config = with_lean_walk(encode(spec, L), ws_config(**kw), D)
    assert config.lean_walk, f"{spec} at {L}: not a lean walk"
    return config


WS = [  # mask, L_max, config: split rows + combine, two tiles per step, no ping-pong
    ("longformer:window=64,global=16", 1024, ws_config(split=8)),
    ("causal", 512, ws_config(stages=4, kstep=2)),
    ("bigbird:block=64,window=3,global=1,random=2,seed=0", 768,
     ws_config(stages=3, pingpong=False, split=8)),
    # dilated masks walked by residue: maps stepping 2 / 4 rows, P times the works
    ("dilated:window=256,dilation=2", 1024, ws_config(stages=4, split=8, period=2)),
    ("dilated:window=200,dilation=4", 1024, ws_config(warps=16, stages=3, period=4)),
    # the tail split: only the first pair row cut, the others written directly
    ("dense", 1024, ws_config(warps=16, split=8, split_rows=1)),
    # lean walks (ws_plan.lean_walk): no walk entries read, only the run's key length cut
    # (plain and mqa-packed run the lean path; the key mask and the bias compile it out of
    # the same config's kernel. The package test below has no lean case: the example model
    # feeds an attention_mask, whose key bits compile it out)
    ("dense", 1024, lean_config("dense", 1024, stages=4)),
    ("bigbird:block=64,window=3,global=1,random=2,seed=0", 768,
     lean_config("bigbird:block=64,window=3,global=1,random=2,seed=0", 768, warps=8, stages=3,
                 min_blocks=3, pingpong=False, split=8)),
]


@pytest.mark.parametrize("spec,L,config", WS, ids=[c.describe() for _, _, c in WS])
@pytest.mark.parametrize("kpm,bias,kv_heads,packed", [
    (False, False, H, False), (True, True, H, False), (True, False, 2, False),
    (False, False, 1, True), (True, False, H, True)],
    ids=["plain", "kpm+bias", "gqa+kpm", "mqa-packed", "packed+kpm"])
def test_ws_attention_cuda_matches_cpu_twin(tmp_path, lib, hopper, spec, L, config, kpm, bias,
                                            kv_heads, packed):
    model = attention_model(tmp_path, hopper, spec, L, config, kpm=kpm, bias=bias,
                            kv_heads=kv_heads, packed=packed)
    cuda, cpu = sessions(model, tmp_path, lib)
    rng = np.random.default_rng(5)
    for B, S in ((1, L), (3, L - 37), (2, 70), (1, 129)):
        feeds = attention_feeds(rng, B, S, kpm, bias, kv_heads=kv_heads, packed=packed)
        got = cuda.run(None, feeds)[0].astype(np.float32)
        want = cpu.run(None, feeds)[0].astype(np.float32)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=f"B={B} S={S}")
        again = cuda.run(None, feeds)[0].astype(np.float32)
        assert np.array_equal(got, again)                   # maps cached, runs repeat


def test_ws_attention_cuda_graph_capture(tmp_path, lib, hopper):
    """Split rows (main + combine kernels, workspace from ORT scratch) under graph capture."""
    spec, L, config = WS[0]
    model = attention_model(tmp_path, hopper, spec, L, config, kpm=True, bias=False)
    cuda, cpu = sessions(model, tmp_path, lib, enable_cuda_graph="1")
    rng = np.random.default_rng(6)
    feeds = attention_feeds(rng, 2, L, True, False)
    inputs = {n: ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0) for n, a in feeds.items()}
    out = ort.OrtValue.ortvalue_from_shape_and_type([2, L, H * D], np.float16, "cuda", 0)
    io = cuda.io_binding()
    for n, v in inputs.items():
        io.bind_ortvalue_input(n, v)
    io.bind_ortvalue_output("out", out)
    for step in range(4):
        if step:
            feeds = attention_feeds(rng, 2, L, True, False)
            for n, a in feeds.items():
                inputs[n].update_inplace(a)
        cuda.run_with_iobinding(io)
        got = out.numpy().astype(np.float32)
        want = cpu.run(None, feeds)[0].astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=f"step {step}")


# ---------------------------------------------------------------- FusedGemm, AddLayerNorm

K, N = 128, 256


def fp16(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float16)


@pytest.mark.parametrize("act,has_bias,has_res,after", list(itertools.product(
    ("none", "gelu_erf", "gelu_tanh"), (False, True), (False, True), (1, 0))))
def test_fused_gemm_cuda_matches_cpu_twin(tmp_path, lib, arch, act, has_bias, has_res, after):
    rng = np.random.default_rng(2)
    split = split_fused_gemm(has_bias, act, has_res, bool(after))
    attrs: dict = {"kernel_abi": KERNEL_ABI, "epilogue_kernel": ""}
    if not split.rest.is_identity:
        kern = epilogue_kernel(split.rest, N, "float16")
        src = render_kernel(kern, (arch,)).source
        attrs = launch_attributes(kern, split.rest, write_kernel(tmp_path, src, arch))
    inits = [numpy_helper.from_array(fp16(rng, K, N, scale=K ** -0.5), "w")]
    names = ["x", "w", "b" if has_bias else "", "r" if has_res else ""]
    if has_bias:
        inits.append(numpy_helper.from_array(fp16(rng, N), "b"))
    while names[-1] == "":
        names.pop()
    node = helper.make_node("FusedGemm", names, ["y"], domain="ai.stofc", activation=act,
                            residual_after_activation=after, **attrs)
    inputs = [helper.make_tensor_value_info("x", F16, ["B", "S", K])]
    if has_res:
        inputs.append(helper.make_tensor_value_info("r", F16, ["B", "S", N]))
    model = make_model(node, inputs, [helper.make_tensor_value_info("y", F16, ["B", "S", N])], inits)
    cuda, cpu = sessions(model, tmp_path, lib)
    for B, S in ((1, 1), (2, 77), (4, 256)):
        feeds = {"x": fp16(rng, B, S, K)}
        if has_res:
            feeds["r"] = fp16(rng, B, S, N)
        got = cuda.run(None, feeds)[0].astype(np.float32)
        want = cpu.run(None, feeds)[0].astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2, err_msg=f"B={B} S={S}")


@pytest.mark.parametrize("has_bias", [True, False])
def test_fused_gemm_hopper_gemm_matches_cpu_twin(tmp_path, lib, hopper, has_bias):
    """FusedGemm with hopper_gemm (OPS.md): runs of >= hopper_gemm_min_m rows take the one-pass
    Hopper GEMM (their outputs differ in bits from the cuBLASLt path's, which rounds the GEMM
    result before the GELU), shorter ones cuBLASLt; both match the CPU twin."""
    from stofc.kernels.gemm_ws import GemmWsProblem, gemm_ws_kernel

    rng = np.random.default_rng(5)
    ep = split_fused_gemm(has_bias, "gelu_erf", False).rest
    kern = epilogue_kernel(ep, N, "float16")
    attrs = launch_attributes(kern, ep, write_kernel(tmp_path, render_kernel(kern, (hopper,)).source,
                                                     hopper))
    gk = gemm_ws_kernel(GemmWsProblem("float16", "gelu_erf", has_bias))
    rel = f"kernels/{gk.name}.sm_90.cubin"
    (tmp_path / rel).write_bytes(compile_source(render_kernel(gk, (hopper,)).source, "sm_90a").binary)
    inits = [numpy_helper.from_array(fp16(rng, K, N, scale=K ** -0.5), "w")]
    if has_bias:
        inits.append(numpy_helper.from_array(fp16(rng, N), "b"))
    names = ["x", "w", "b"] if has_bias else ["x", "w"]
    inputs = [helper.make_tensor_value_info("x", F16, ["B", "S", K])]
    outputs = [helper.make_tensor_value_info("y", F16, ["B", "S", N])]
    runs = {}
    for min_m in (100, 1 << 30):     # the Hopper GEMM from 100 rows, and never
        node = helper.make_node("FusedGemm", names, ["y"], domain="ai.stofc", activation="gelu_erf",
                                hopper_gemm=f"{rel}:{gk.name}", hopper_gemm_min_m=min_m, **attrs)
        cuda, cpu = sessions(make_model(node, inputs, outputs, inits), tmp_path, lib)
        for B, S in ((1, 1), (2, 77), (4, 256), (3, 1000)):
            feeds = {"x": fp16(np.random.default_rng(B * S), B, S, K)}
            got = cuda.run(None, feeds)[0]
            want = cpu.run(None, feeds)[0].astype(np.float32)
            np.testing.assert_allclose(got.astype(np.float32), want, rtol=1e-2, atol=1e-2,
                                       err_msg=f"min_m={min_m} B={B} S={S}")
            runs[(min_m, B * S)] = got
    for m in (154, 1024, 3000):
        assert not np.array_equal(runs[(100, m)], runs[(1 << 30, m)]), m   # another kernel ran
    assert np.array_equal(runs[(100, 1)], runs[(1 << 30, 1)])            # cuBLASLt both times


@pytest.mark.parametrize("has_res,rms,has_beta,has_sum", [
    c for c in itertools.product((False, True), repeat=4) if not (c[1] and c[2])])
def test_add_layer_norm_cuda_matches_cpu_twin(tmp_path, lib, arch, has_res, rms, has_beta,
                                              has_sum):
    rng = np.random.default_rng(3)
    ep = norm_epilogue(has_residual=has_res, rms=rms, has_beta=has_beta, has_sum=has_sum)
    kern = epilogue_kernel(ep, N, "float16")
    src = render_kernel(kern, (arch,)).source
    attrs = launch_attributes(kern, ep, write_kernel(tmp_path, src, arch))
    inits = [numpy_helper.from_array(fp16(rng, N), "g")]
    names = ["x", "r" if has_res else "", "g"]
    if has_beta:
        inits.append(numpy_helper.from_array(fp16(rng, N), "be"))
        names.append("be")
    outs = ["y", "s"] if has_sum else ["y"]
    node = helper.make_node("AddLayerNorm", names, outs, domain="ai.stofc", epsilon=1e-5,
                            rms=int(rms), **attrs)
    inputs = [helper.make_tensor_value_info("x", F16, ["B", "S", N])]
    if has_res:
        inputs.append(helper.make_tensor_value_info("r", F16, ["B", "S", N]))
    outputs = [helper.make_tensor_value_info(o, F16, ["B", "S", N]) for o in outs]
    cuda, cpu = sessions(make_model(node, inputs, outputs, inits), tmp_path, lib)
    for B, S in ((1, 3), (2, 129)):
        feeds = {"x": fp16(rng, B, S, N)}
        if has_res:
            feeds["r"] = fp16(rng, B, S, N)
        for got, want in zip(cuda.run(None, feeds), cpu.run(None, feeds), strict=True):
            np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                                       rtol=1e-2, atol=2e-2)


def test_rms_norm_with_shift_fails_at_session_creation_on_cuda(tmp_path, lib):
    node = helper.make_node("AddLayerNorm", ["x", "", "g", "be"], ["y"], domain="ai.stofc",
                            rms=1)
    inits = [numpy_helper.from_array(np.ones(N, np.float16), n) for n in ("g", "be")]
    model = make_model(node, [helper.make_tensor_value_info("x", F16, ["B", N])],
                       [helper.make_tensor_value_info("y", F16, ["B", N])], inits)
    with pytest.raises(Exception, match=r"stofc AddLayerNorm.*no CUDA launch attributes"):
        sessions(model, tmp_path, lib)


# ---------------------------------------------------------------- packages

MASKS = ["bigbird:block=16,window=3,global=1,random=1,seed=0", "longformer:window=64,global=1",
         "causal", "strided:stride=32"]


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    sys.path.insert(0, str(ROOT / "examples"))
    from build_model import build_model
    path = tmp_path_factory.mktemp("model") / "model.onnx"
    onnx.save(build_model(seq=512), str(path))          # position embeddings for S <= 512
    return path


def stofc_providers(session, run) -> dict[str, set[str]]:
    """op type -> providers it ran on, from ORT's profile of ``run()``."""
    run()
    events = json.loads(Path(session.end_profiling()).read_text())
    seen: dict[str, set[str]] = {}
    for e in events:
        args = e.get("args", {})
        if args.get("op_name") in ("SparseAttention", "FusedGemm", "AddLayerNorm", "GatedGemm",
                                   "Rotary"):
            seen.setdefault(args["op_name"], set()).add(args.get("provider", "?"))
    return seen


@pytest.mark.parametrize("mask,dtype", [(m, "fp16") for m in MASKS] + [(MASKS[0], "bf16")])
def test_package_on_cuda_matches_cpu_and_original(tmp_path, example, mask, dtype):
    from stofc.frontend import load_model
    from stofc.package.load import load
    from stofc.package.verify import compare, make_inputs, verify_package
    from stofc.pipeline import Instruments, compile_model
    from stofc.targets import detect

    pkg = compile_model(example, mask, gpu=detect().name, dtype=dtype, max_seq_len=256,
                        out_dir=tmp_path / "pkg", instruments=Instruments(progress=False))
    report = verify_package(pkg, model=example, provider="cuda")
    assert report.passed, report.to_dict()

    def profiled(so):
        so.enable_profiling = True
        so.profile_file_prefix = str(tmp_path / "prof")

    cuda = load(pkg, providers=[CUDA, CPU], session_options_hook=profiled)
    graph = load_model(example)
    feeds, real = make_inputs(graph, 3, 200, np.random.default_rng(4))
    names = [o.name for o in cuda.get_outputs()]
    placed = stofc_providers(cuda, lambda: cuda.run(names, feeds))
    assert placed and all(p == {CUDA} for p in placed.values()), placed
    got = cuda.run(names, feeds)
    if dtype == "fp16":                     # the CPU twins run float and float16 only
        cpu = load(pkg, providers=[CPU])
        for g, w in zip(got, cpu.run(names, feeds), strict=True):
            if g.ndim == 3:
                err, ref, _ = compare(g, w, real)
                assert err <= 1e-2 * max(ref, 1e-6), (err, ref)
    assert all(np.array_equal(a, b) for a, b in zip(got, cuda.run(names, feeds), strict=True))
    io = cuda.io_binding()
    for n, a in feeds.items():
        io.bind_ortvalue_input(n, ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0))
    for n in names:
        io.bind_output(n, "cuda")
    cuda.run_with_iobinding(io)
    bound = io.copy_outputs_to_cpu()
    assert all(np.array_equal(a, b) for a, b in zip(got, bound, strict=True))


LONGFORMER = "longformer:window=64,global=16"


@pytest.mark.parametrize("dtype,config,mask,heads", [
    ("bf16", ws_config(stages=3, split=8), LONGFORMER, 2),
    ("fp16", ws_config(stages=4, kstep=2, split=8), LONGFORMER, 2),
    ("bf16", ws_config(warps=16, split=8), LONGFORMER, 2),
    ("fp16", ws_config(warps=16, stages=3), LONGFORMER, 2),
    ("fp16", ws_config(stages=4, split=8, period=2), "dilated:window=128,dilation=2", 2),
    ("fp16", ws_config(warps=20, stages=4, split=8), LONGFORMER, 4),
    ("bf16", ws_config(warps=20, stages=4, pingpong=False), "causal", 4),
    ("bf16", ws_config(warps=16, split=8, split_rows=2), "causal", 2),
    ("fp16", ws_config(warps=8, stages=3, split=8, min_blocks=3, pingpong=False), LONGFORMER, 4),
    ("bf16", ws_config(warps=8, stages=2, split=8, min_blocks=3, pingpong=False),
     "bigbird:block=64,window=3,global=1,random=2,seed=0", 4)],
    ids=["bf16-split", "fp16-kstep2-split", "bf16-3consumers-split", "fp16-3consumers",
         "fp16-residue-split", "fp16-4consumers-split-d64", "bf16-4consumers-causal-d64",
         "bf16-3consumers-tail-split", "fp16-1consumer-split-d64", "bf16-1consumer-bigbird-d64"])
def test_ws_package_on_cuda_matches_the_original(tmp_path_factory, tmp_path, hopper, dtype,
                                                 config, mask, heads):
    """A package whose attention is the warp-specialised kernel (head_dim 128 with two heads,
    64 with four; forced through the plan as the tuner would) verifies on the CUDA EP
    against the original model."""
    from stofc.package.load import read_plan
    from stofc.package.verify import verify_package
    from stofc.pipeline import Instruments, compile_model, recompile_package
    from stofc.targets import detect
    from tests.unit.test_ortlib_package import with_attention_config

    sys.path.insert(0, str(ROOT / "examples"))
    from build_model import build_model
    model = tmp_path_factory.mktemp("ws_model") / "model.onnx"
    onnx.save(build_model(layers=2, hidden=256, heads=heads, seq=1024), str(model))
    quiet = Instruments(progress=False)
    pkg = compile_model(model, mask, gpu=detect().name, dtype=dtype,
                        max_seq_len=1024, out_dir=tmp_path / "pkg", instruments=quiet)
    recompile_package(pkg, with_attention_config(read_plan(pkg), config), instruments=quiet)
    doc = json.loads((pkg / "plan.json").read_text())
    assert {a["config"]["kind"] for a in doc["attention"]} == {"ws"}
    report = verify_package(pkg, model=model, provider="cuda",
                            cases=[(1, 1024), (3, 500), (2, 129)])
    assert report.passed, report.to_dict()
