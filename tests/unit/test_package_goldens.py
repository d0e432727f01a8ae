"""Whole packages against their recorded fingerprints: a refactor leaves every byte alone.

Each case compiles (or re-writes, or only rewrites) a model the way users and the
tuner do and compares :func:`tests.package_fingerprint.fingerprint` with
``tests/goldens/packages/<case>.json``: plan.json (less provenance), every kernel
source, the mask binaries and attention launch plans, the mask arrays and model.onnx.
The cases cover every attention kernel (mma.sync and wgmma block-wise, row-wise,
gathered, residue-permuted, the warp-specialised kernel as the selector's pick and forced
through the plan with split rows, run-time variants: the query split and tuned length
buckets), every downstream family (vendor cuBLASLt with a tuned rank, the GEMM
template, GEMM+GEMM, GEMM+norm, Add+Norm), fp16 and bf16, packed and unpacked Q/K/V,
four exporter fixtures compiled whole with their own masks (RoPE, grouped-query and
multi-query attention, soft-capping, local/global layers, activations ONNX Runtime runs)
and three rewritten for the CPU twins.

A change that alters a package on purpose regenerates the goldens with
``STOFC_REGEN_GOLDENS=1 pytest tests/unit/test_package_goldens.py`` and shows the
difference in review.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import onnx
import pytest

from stofc.frontend import load_model
from stofc.kernels.attention import AttentionConfig
from stofc.package.load import read_plan, read_plan_document
from stofc.pipeline import Instruments, compile_model, recompile_package
from stofc.plan.build import plan_layer
from stofc.plan.scheme import FusionScheme
from stofc.targets import get_profile
from tests.package_fingerprint import fingerprint, lowered_fingerprint
from tests.unit.rewrite_helpers import rewrite_graph, with_lt_rank

ROOT = Path(__file__).resolve().parents[2]
GOLDENS = ROOT / "tests" / "goldens" / "packages"
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(ROOT / "examples"))
from build_model import build_model  # noqa: E402

QUIET = Instruments(progress=False)
REGEN = bool(os.environ.get("STOFC_REGEN_GOLDENS"))
pytestmark = pytest.mark.slow


def _check(case: str, got: dict) -> None:
    path = GOLDENS / f"{case}.json"
    text = json.dumps(got, indent=1, sort_keys=True, default=str) + "\n"
    if REGEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    want = json.loads(path.read_text())
    got = json.loads(text)
    if got != want:
        files_got, files_want = got.get("files", {}), want.get("files", {})
        diff = [key for key in sorted(set(files_got) | set(files_want))
                if files_got.get(key) != files_want.get(key)]
        assert got == want, f"{case}: package differs from {path} (files: {diff})"


def _model(tmp_path: Path, **options) -> Path:
    path = tmp_path / "model.onnx"
    onnx.save(build_model(**options), str(path))
    return path


COMPILED = {
    # name: (build_model options, mask, compile options)
    "demo_bigbird_fp16": ({"layers": 2}, "bigbird:block=16,window=3,global=1,random=2,seed=0",
                          {"gpu": "h100", "dtype": "fp16", "max_seq_len": 128}),
    "bf16_sliding": ({"layers": 2}, "sliding:window=16", {"dtype": "bf16", "max_seq_len": 64}),
    "wgmma_causal": ({"layers": 1, "hidden": 256, "heads": 4, "seq": 256}, "causal",
                     {"gpu": "h100", "max_seq_len": 256}),
    "split_variant_h200": ({"layers": 2, "hidden": 128, "heads": 2, "seq": 256},
                           "bigbird:block=64,window=3,global=1,random=1,seed=0",
                           {"gpu": "h200", "max_seq_len": 256}),
    "dilated_512": ({"layers": 1, "seq": 512}, "dilated:window=96,dilation=2",
                    {"max_seq_len": 512}),
    "unpacked_causal": ({"layers": 1}, "causal", {"max_seq_len": 64, "pack_qkv": False}),
    # head_dim 64 at L=1024 on an H100: the selector picks the warp-specialised kernel
    "ws_selected_bf16": ({"layers": 2, "hidden": 128, "heads": 2, "seq": 1024},
                         "longformer:window=64,global=16", {"dtype": "bf16", "max_seq_len": 1024}),
}
# exporter fixtures compiled whole (head_dim 32): their own masks, RoPE, grouped-query and
# multi-query attention, soft-capping, local/global layers, activations left to ORT
FIXTURE_PACKAGES = {
    "llama_optimum_op18": ("model", {}),
    "gemma2_dynamo_op18_eager": ("model", {}),
    "qwen2_ts_op17": ("model", {"dtype": "bf16"}),
    "gptneo_ts_op17_eager": ("sliding:window=40,causal=true", {}),
}


@pytest.mark.parametrize("fixture", sorted(FIXTURE_PACKAGES))
def test_compiled_fixture(fixture, tmp_path):
    mask, options = FIXTURE_PACKAGES[fixture]
    pkg = compile_model(FIXTURES / f"{fixture}.onnx", mask, max_seq_len=64,
                        out_dir=tmp_path / "pkg", instruments=QUIET, **options)
    _check(f"fixture_package_{fixture}", fingerprint(pkg))


@pytest.mark.parametrize("case", sorted(COMPILED))
def test_compiled_package(case, tmp_path):
    options, mask, compile_options = COMPILED[case]
    pkg = compile_model(_model(tmp_path, **options), mask, out_dir=tmp_path / "pkg",
                        instruments=QUIET, **compile_options)
    _check(case, fingerprint(pkg))


def _with_attention(plan, config: AttentionConfig):
    """``plan`` with every attention segment set to ``config`` (a tuner's pick)."""
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


def test_tuned_package_with_buckets_and_ranks(tmp_path):
    """What the tuner writes: a cuBLASLt rank per bucket and a shorter bucket's attention."""
    model = _model(tmp_path, layers=2)
    pkg = compile_model(model, "longformer:window=8,global=2", max_seq_len=128,
                        out_dir=tmp_path / "pkg", instruments=QUIET)
    plan = read_plan(pkg)
    big = with_lt_rank(plan, 3, 128)
    small = with_lt_rank(_with_attention(plan, AttentionConfig("row", 64, 2, 4)), 5, 64)
    recompile_package(pkg, big, instruments=QUIET, buckets=((64, small), (128, big)))
    _check("tuned_buckets", fingerprint(pkg))


SCHEMES = {
    "scheme_gemm_gemm": [[0, 1], [2], [3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]],
    "scheme_add_norm": [[0, 1], [2], [3, 4], [5, 6], [7], [8, 9], [10, 11, 12], [13]],
}


@pytest.mark.parametrize("case", sorted(SCHEMES))
def test_other_fusion_schemes(case, tmp_path):
    """The hand-written GEMM template, GEMM+GEMM, GEMM+norm and Add+Norm kernels."""
    model = _model(tmp_path, layers=2)
    pkg = compile_model(model, "sliding:window=16", max_seq_len=64, out_dir=tmp_path / "pkg",
                        instruments=QUIET)
    doc = read_plan_document(pkg)
    plan, masks = doc.plan, doc.masks()
    graph = load_model(model, pack_projections=True)
    scheme = FusionScheme.from_segments(SCHEMES[case])
    layers = tuple(plan_layer(layer, scheme, tokens=64, profile=get_profile("h100"),
                              dtype="float16", fmt=masks[layer.index], max_seq_len=64,
                              vendor=False)
                   for layer in graph.layers)
    recompile_package(pkg, replace(plan, layers=layers), instruments=QUIET)
    _check(case, fingerprint(pkg))


@pytest.mark.parametrize("fixture", ["bert_ts_op17_eager", "gpt2_dynamo_op18",
                                     "t5_dynamo_op18"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rewritten_fixture(fixture, dtype, tmp_path):
    graph = load_model(FIXTURES / f"{fixture}.onnx")
    _, model, emitted = rewrite_graph(graph, "sliding:window=8", tmp_path, max_seq_len=32,
                                      dtype=dtype, causal_from_graph=True)
    for node in model.graph.node:   # the mask binaries' paths are this run's temporary files
        for attr in node.attribute:
            if attr.name == "mask_file":
                attr.s = Path(attr.s.decode()).name.encode()
    # and so is the package directory the rewrite helper records for the CPU session
    kept = [p for p in model.metadata_props if p.key != "stofc.test.package_dir"]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    _check(f"fixture_{fixture}_{dtype}", lowered_fingerprint(model, emitted))


def test_ws_forced_package(tmp_path):
    """A package whose attention is the warp-specialised kernel (forced through the plan, as
    the tuner would): its sm_90a kernel with the combine entry and its split launch plan."""
    model = _model(tmp_path, layers=2, hidden=128, heads=2, seq=1024)
    pkg = compile_model(model, "longformer:window=64,global=16", max_seq_len=1024,
                        out_dir=tmp_path / "pkg", instruments=QUIET)
    ws = AttentionConfig("ws", 64, 16, 12, 3, 1, mma="wgmma", split=8)
    recompile_package(pkg, _with_attention(read_plan(pkg), ws), instruments=QUIET)
    _check("ws_forced", fingerprint(pkg))
