"""A package's CUDA launch attributes (OPS.md, kernel_abi 4), written without a GPU.

Every ai.stofc node of a compiled package must carry what its CUDA twin launches:
SparseAttention a ``*.plan.bin`` equal to what ``AttentionOp`` would upload for the
plan's config (row-wise, block-wise, gathered, residue-permuted); FusedGemm and
AddLayerNorm an Add+Norm kernel compiled for exactly the epilogue the twin leaves
to it (:func:`stofc.lower.twins.split_fused_gemm`, ``norm_epilogue``), EmbedLayerNorm the
embedding kernel compiled for its tables, summands, beta and gamma type, each in
the package with its PTX and source, hashed in the manifest and listed in plan.json.
The CPU EP still runs the package to the masked reference.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from stofc.kernels.attention import AttentionConfig
from stofc.kernels.attention.config import attention_family
from stofc.kernels.attention.launch import launch_data
from stofc.kernels.gemm_ws import DEFAULT as GEMM_WS_DEFAULT
from stofc.kernels.gemm_ws import MIN_ROWS as GEMM_WS_MIN_ROWS
from stofc.kernels.gemm_ws import entry_name as gemm_ws_entry
from stofc.kernels.gemm_ws import twin_choice
from stofc.kernels.vendor_gemm import split_fused_gemm
from stofc.lower.twins import KERNEL_ABI, norm_epilogue
from stofc.masks import load as load_format
from stofc.package.layout import launch_plan_file
from stofc.package.load import read_plan, read_plan_document
from stofc.package.manifest import read_manifest
from stofc.package.maskbin import read_attention_plan
from stofc.package.verify import verify_package
from stofc.pipeline import Instruments, compile_model, recompile_package

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from build_model import build_model  # noqa: E402

QUIET = Instruments(progress=False)


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model.onnx"
    onnx.save(build_model(), str(path))
    return path


@pytest.fixture(scope="module")
def example512(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model512") / "model.onnx"
    onnx.save(build_model(layers=1, seq=512), str(path))
    return path


def attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def fmt_head_dim(model: onnx.ModelProto, node: onnx.NodeProto) -> int:
    return attrs(node)["head_dim"]


def with_attention_config(plan, config):
    """``plan`` with every attention segment naming ``config``: the tuned-plan path
    (``recompile_package`` keeps a config its plan names) forces the kernel."""
    layers = []
    for lp in plan.layers:
        segs = []
        for seg in lp.segments:
            if seg.family == "attention":
                params = dict(seg.kernel.params)
                params.update({k: getattr(config, k) for k in AttentionConfig.__dataclass_fields__})
                seg = replace(seg, kernel=replace(seg.kernel, params=tuple(params.items())))
            segs.append(seg)
        layers.append(replace(lp, segments=tuple(segs)))
    return replace(plan, layers=tuple(layers))


def check_cuda_attributes(pkg: Path) -> dict[str, int]:
    """Assert every ai.stofc node's CUDA attributes; returns a count per op type."""
    model = onnx.load(str(pkg / "model.onnx"))
    doc = json.loads((pkg / "plan.json").read_text())
    widths = {t.name: list(t.dims) for t in model.graph.initializer}
    hashed = {f for f, _, _ in read_manifest(pkg).files}
    listed = {f for k in doc["kernels"] for f in k["files"].values()}
    by_layer = {a["layer"]: a for a in doc["attention"]}
    masks = {m["id"]: m for m in doc["mask"]["formats"]}
    node_layer = {n: s["layer"] for s in doc["segments"] for n in s["nodes"]}
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if node.domain != "ai.stofc":
            continue
        a = attrs(node)
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
        inputs = list(node.input) + [""] * 4
        if node.op_type == "KeyPrep":   # no attributes: it launches the library's own kernel
            assert not a, node.name
            continue
        assert a["kernel_abi"] == KERNEL_ABI, node.name
        if node.op_type == "SparseAttention":
            entry = by_layer[node_layer[node.name]]
            cfg = AttentionConfig(**entry["config"])
            fmt = load_format(pkg / masks[entry["mask"]]["npz"])
            plan = read_attention_plan(pkg / a["launch_plan"])
            want = launch_data(fmt, cfg)
            for field, _ in want.ARRAYS:
                assert np.array_equal(getattr(plan, field), getattr(want, field)), field
            family = attention_family(cfg.kind)
            assert plan.kind == cfg.kind
            assert a["launch_plan"] == launch_plan_file(fmt, family.launch_key(cfg))
            if cfg.kind != "ws":
                assert plan.permuted == cfg.permute
            assert {k: a[k] for k in entry["launch"]} == entry["launch"]
            assert dict(family.launch(cfg, fmt_head_dim(model, node))) == entry["launch"]
            assert a["launch_plan"] in hashed
            continue
        if node.op_type == "GatedGemm":
            # the gated-activation kernel on cuBLASLt's [M, 2F] output (OPS.md): its entry
            # names the node's activation and the half width F, never a bias (Lt adds it)
            half = widths[inputs[1]][-1] // 2
            path, entry_name = a["epilogue_kernel"].rsplit(":", 1)
            assert entry_name.startswith("stofc_glu_") and f"_{a['activation']}_f{half}_" in \
                entry_name and "_b_" not in entry_name, (node.name, a)
            assert entry_name.encode() in (pkg / path).read_bytes()
            assert f"_t{a['epilogue_threads'] // a['epilogue_rows']}x{a['epilogue_rows']}" \
                in entry_name
            assert path in hashed and path in listed, path
            continue
        if node.op_type == "Rotary":
            # the rotary kernel compiled for the node's head_dim, rotary_dim and form
            path, entry_name = a["kernel"].rsplit(":", 1)
            form = "il" if a.get("interleaved", 0) else "rh"
            assert entry_name.startswith(f"stofc_rotary_{read_manifest(pkg).dtype}_d{a['head_dim']}_"
                                         f"r{a['rotary_dim']}_{form}_"), (node.name, a)
            assert entry_name.encode() in (pkg / path).read_bytes()
            assert path in hashed and path in listed, path
            continue
        if node.op_type == "EmbedLayerNorm":
            # the embedding kernel compiled for the node's tables, summands, beta and gamma type
            path, entry_name = a["kernel"].rsplit(":", 1)
            ins = list(node.input) + [""] * 8
            f32p = "_f32p" if any(t.name == ins[6] and t.data_type == onnx.TensorProto.FLOAT
                                  for t in model.graph.initializer) else ""
            summands = sum(bool(ins[i]) for i in (1, 3, 5))
            assert entry_name.startswith(
                f"stofc_embed_norm_{read_manifest(pkg).dtype}{f32p}_e{summands}_"
                f"{'ln' if ins[7] else 'ln_ns'}_n{widths[ins[1]][-1]}_t"), (node.name, a)
            assert entry_name.encode() in (pkg / path).read_bytes()
            stem = path[:-len(".sm_90.cubin")]
            for rel in (path, f"{stem}.compute_90.ptx", f"kernels/{entry_name}.cu"):
                assert rel in hashed and rel in listed, rel
            continue
        if node.op_type == "FusedGemm":
            width = widths[inputs[1]][-1]
            ep = split_fused_gemm(bool(inputs[2]), a["activation"], bool(inputs[3]),
                                  bool(a["residual_after_activation"])).rest
            manifest = read_manifest(pkg)
            hopper = twin_choice(arch=manifest.arch, dtype=manifest.dtype, act=a["activation"],
                                 has_bias=bool(inputs[2]), has_residual=bool(inputs[3]),
                                 fp32_out=any(t.name == inputs[2] and t.data_type ==
                                              onnx.TensorProto.FLOAT
                                              for t in model.graph.initializer),
                                 k=widths[inputs[1]][0], n=width)
            assert ("hopper_gemm" in a) == (hopper is not None), (node.name, a)
            if hopper is not None:
                # the one-pass Hopper GEMM for long runs (OPS.md): built for sm_90a, listed
                path, entry_name = a["hopper_gemm"].rsplit(":", 1)
                assert entry_name == gemm_ws_entry(hopper, GEMM_WS_DEFAULT), (node.name, a)
                assert a["hopper_gemm_min_m"] == GEMM_WS_MIN_ROWS
                assert entry_name.encode() in (pkg / path).read_bytes()
                stem = path[:-len(".sm_90.cubin")]
                for rel in (path, f"{stem}.compute_90.ptx", f"kernels/{entry_name}.cu"):
                    assert rel in hashed and rel in listed, rel
        else:
            width = widths[inputs[2]][-1]
            ep = norm_epilogue(has_residual=bool(inputs[1]), rms=bool(a["rms"]),
                               has_beta=bool(inputs[3]),
                               has_sum=len(node.output) > 1 and bool(node.output[1]))
        if ep.is_identity:
            assert a["epilogue_kernel"] == "", node.name
            continue
        path, entry_name = a["epilogue_kernel"].rsplit(":", 1)
        assert a["epilogue"] == ep.tag and f"_n{width}_" in entry_name, (node.name, a)
        assert entry_name.encode() in (pkg / path).read_bytes()
        assert a["epilogue_threads"] % a["epilogue_rows"] == 0
        assert f"_t{a['epilogue_threads'] // a['epilogue_rows']}x{a['epilogue_rows']}" in entry_name
        stem = path[:-len(".sm_90.cubin")]
        for rel in (path, f"{stem}.compute_90.ptx", f"kernels/{entry_name}.cu"):
            assert rel in hashed and rel in listed, rel
    return counts


def test_compiled_package_carries_cuda_launch_attributes(example, tmp_path):
    pkg = compile_model(example, "bigbird:block=16,window=3,global=1,random=1,seed=0",
                        gpu="h100", dtype="fp16", max_seq_len=128, out_dir=tmp_path / "pkg",
                        instruments=QUIET)
    counts = check_cuda_attributes(pkg)
    # per layer: the packed Q|K|V GEMM, the output projection and the two FFN GEMMs
    assert counts == {"SparseAttention": 2, "FusedGemm": 8, "AddLayerNorm": 4, "KeyPrep": 1}
    model = onnx.load(str(pkg / "model.onnx"))
    hopper = [n.name for n in model.graph.node if "hopper_gemm" in attrs(n)]
    assert len(hopper) == 2          # each layer's erf-GELU FFN GEMM (h100: sm_90)
    assert all(a["kernel_abi"] == KERNEL_ABI
               for a in json.loads((pkg / "plan.json").read_text())["attention"])
    assert verify_package(pkg, cases=[(2, 100)]).passed


@pytest.mark.parametrize("config,dtype", [
    (AttentionConfig("block", 64, 16, 4, 2, 1, gather=True), "bf16"),
    (AttentionConfig("block", 64, 16, 2, 2, 2, permute=True), "fp16"),
], ids=["gather-bf16", "permute-fp16"])
def test_gathered_and_permuted_attention_plans(example512, tmp_path, config, dtype):
    pkg = compile_model(example512, "dilated:window=96,dilation=2", dtype=dtype, max_seq_len=512,
                        out_dir=tmp_path / "pkg", instruments=QUIET)
    recompile_package(pkg, with_attention_config(read_plan(pkg), config), instruments=QUIET)
    assert check_cuda_attributes(pkg)["SparseAttention"] == 1
    plans = list((pkg / "masks").glob("*.plan.bin"))
    assert len(plans) == 1 and read_attention_plan(plans[0]).permuted == config.permute
    model = onnx.load(str(pkg / "model.onnx"))
    kernels = [attrs(n).get("epilogue_kernel") or attrs(n)["kernel"] for n in model.graph.node
               if n.domain == "ai.stofc" and n.op_type != "KeyPrep"]   # KeyPrep: no kernel
    tag = {"bf16": ("bfloat16", "_bf16_"), "fp16": ("float16", "_f16_")}[dtype]
    assert all(f"stofc_add_norm_{tag[0]}_" in k or tag[1] in k or k == "" for k in kernels)
    assert verify_package(pkg, cases=[(1, 300)]).passed   # CPU twins: float16 and bfloat16


@pytest.mark.parametrize("segments", [   # the packed graph's chain: qkv GEMM + bias, attention
    [[0, 1], [2], [3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]],
    [[0, 1], [2], [3, 4], [5, 6], [7], [8, 9], [10, 11, 12], [13]],
], ids=["gemm_norm+gemm_gemm", "add_norm"])
def test_other_fusion_schemes_carry_cuda_attributes(example, tmp_path, segments):
    from stofc.frontend import load_model
    from stofc.plan.build import plan_layer
    from stofc.plan.scheme import FusionScheme
    from stofc.targets import get_profile

    pkg = compile_model(example, "sliding:window=16", max_seq_len=64, out_dir=tmp_path / "pkg",
                        instruments=QUIET)
    plan, masks = read_plan(pkg), read_plan_document(pkg).masks()
    scheme = FusionScheme.from_segments(segments)
    layers = tuple(plan_layer(layer, scheme, tokens=64, profile=get_profile("h100"),
                              dtype="float16", fmt=masks[layer.index], max_seq_len=64,
                              vendor=False)
                   for layer in load_model(example, pack_projections=True).layers)
    recompile_package(pkg, replace(plan, layers=layers), instruments=QUIET)
    counts = check_cuda_attributes(pkg)
    assert counts["FusedGemm"] >= 8 and counts["AddLayerNorm"] >= 4


@pytest.fixture(scope="module")
def example_d64(tmp_path_factory) -> Path:
    """head_dim 64 (hidden 128, 2 heads): a size the warp-specialised kernel takes."""
    path = tmp_path_factory.mktemp("model_d64") / "model.onnx"
    onnx.save(build_model(layers=2, hidden=128, heads=2, seq=1024), str(path))
    return path


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_ws_attention_package_runs_on_the_cpu_ep(example_d64, tmp_path, dtype):
    """A package whose attention is the warp-specialised kernel (forced through the plan, as
    the tuner would): its plan file, attributes and sm_90a kernel are in the package, and
    the CPU twins (which ignore the CUDA attributes) compute the model under the mask."""
    ws = AttentionConfig("ws", 64, 16, 12, 3, 1, mma="wgmma", split=8)
    pkg = compile_model(example_d64, "longformer:window=64,global=16", dtype=dtype,
                        max_seq_len=1024, out_dir=tmp_path / "pkg", instruments=QUIET)
    recompile_package(pkg, with_attention_config(read_plan(pkg), ws), instruments=QUIET)
    assert check_cuda_attributes(pkg)["SparseAttention"] == 2
    doc = json.loads((pkg / "plan.json").read_text())
    assert {a["config"]["kind"] for a in doc["attention"]} == {"ws"}
    plans = sorted(p.name for p in (pkg / "masks").glob("*.plan.bin"))
    assert len(plans) == 1 and plans[0].endswith(".ws-split8.plan.bin")
    assert read_attention_plan(pkg / "masks" / plans[0]).splits      # global rows are split
    (kernel,) = [k for k in doc["kernels"] if k["name"].startswith("stofc_attn_ws_")]
    assert kernel["nvrtc_targets"] == {"sm_90": "sm_90a", "compute_90": "compute_90a"}
    assert kernel["entry_points"] == [kernel["name"], f"{kernel['name']}_combine"]
    cubin = (pkg / kernel["files"]["sm_90"]).read_bytes()
    assert cubin[:4] == b"\x7fELF" and f"{kernel['name']}_combine".encode() in cubin
    model = onnx.load(str(pkg / "model.onnx"))
    (node, *_) = [n for n in model.graph.node if n.op_type == "SparseAttention"]
    a = attrs(node)
    assert a["kernel"] == f"{kernel['files']['sm_90']}:{kernel['name']}"
    assert (a["block_threads"], a["blocks_per_tile_row"]) == (384, 1) and a["smem_bytes"] > 48 * 1024
    assert verify_package(pkg, cases=[(2, 300), (1, 1024)]).passed
