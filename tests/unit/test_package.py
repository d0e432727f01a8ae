"""The package end to end on the CPU: compile, load in ORT, match the masked reference."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import stofc
from stofc.frontend import load_model
from stofc.lower.rewrite import DOMAIN
from stofc.masks import load as load_format
from stofc.package.manifest import read_manifest, sha256_file
from stofc.package.ortlib import LIBRARY_NAME, build_library
from stofc.package.reference import inject_mask
from stofc.package.verify import compare, make_inputs, verify_package
from stofc.pipeline import Instruments, compile_model
from tests.unit.rewrite_helpers import cpu_session, rewrite_graph

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(ROOT / "examples"))
from build_model import build_model  # noqa: E402

BIGBIRD = "bigbird:block=16,window=3,global=1,random=1,seed=0"


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model.onnx"
    onnx.save(build_model(), str(path))
    return path


@pytest.fixture(scope="module")
def package(example, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pkg") / "model.stofc"
    return compile_model(example, BIGBIRD, gpu="h100", dtype="fp16", max_seq_len=128,
                         out_dir=out, instruments=Instruments(progress=False))


def test_package_layout(package):
    names = {p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file()}
    assert {"model.onnx", "plan.json", "manifest.json", LIBRARY_NAME} <= names
    manifest = read_manifest(package)
    assert {f for f, _, _ in manifest.files} == names - {"manifest.json"}
    for rel, digest, size in manifest.files:
        assert sha256_file(package / rel) == digest and (package / rel).stat().st_size == size
    cubins = [n for n in names if n.endswith(".sm_90.cubin")]
    ptx = [n for n in names if n.endswith(".compute_90.ptx")]
    sources = [n for n in names if n.startswith("kernels/") and n.endswith(".cu")]
    assert cubins and len(cubins) == len(ptx) == len(sources)
    assert any(n.startswith("masks/") and n.endswith(".bin") for n in names)
    assert any(n.startswith("masks/") and n.endswith(".npz") for n in names)
    assert manifest.arch == "sm_90" and manifest.ptx == "compute_90"


def test_plan_json_records_everything(package, example):
    doc = json.loads((package / "plan.json").read_text())
    assert doc["format"] == "stofc-package-plan" and doc["version"] == 1
    plan = stofc.package.load.read_plan(package)
    assert plan.dtype == "float16" and plan.arch == "sm_90" and len(plan.layers) == 2
    attn = [s for lp in plan.layers for s in lp.segments if s.family == "attention"]
    assert all(s.kernel.template.startswith("attention/") for s in attn)
    assert [a["layer"] for a in doc["attention"]] == [0, 1]
    assert doc["mask"]["spec"] == BIGBIRD and doc["mask"]["causal_from_model"] is False
    assert doc["provenance"]["nvrtc"] and doc["provenance"]["source_model_sha256"] == \
        sha256_file(example)
    kernel_files = {f for k in doc["kernels"] for f in k["files"].values()}
    assert all((package / f).is_file() for f in kernel_files)
    for seg in doc["segments"]:
        assert seg["ops"] and all(op.startswith(("ai.stofc:", "onnx:")) for op in seg["ops"])
        if seg["kernel"]:
            assert (package / seg["kernel"].split(":")[0]).is_file()


def test_model_keeps_io_and_uses_custom_ops(package, example):
    original, rewritten = onnx.load(str(example)), onnx.load(str(package / "model.onnx"))
    assert [(i.name, i.type) for i in original.graph.input] == \
        [(i.name, i.type) for i in rewritten.graph.input]
    assert [(o.name, o.type.tensor_type.elem_type) for o in original.graph.output] == \
        [(o.name, o.type.tensor_type.elem_type) for o in rewritten.graph.output]
    ops = [n.op_type for n in rewritten.graph.node if n.domain == DOMAIN]
    assert ops.count("SparseAttention") == 2
    assert "FusedGemm" in ops and "AddLayerNorm" in ops
    assert not any(n.op_type in ("Softmax", "MatMul") for n in rewritten.graph.node)
    # only the embeddings' LayerNormalization is left to ORT
    assert [n.op_type for n in rewritten.graph.node].count("LayerNormalization") == 1


def test_load_runs_on_cpu_and_matches_the_masked_reference(package, example):
    session = stofc.load(package, providers=["CPUExecutionProvider"])
    graph = load_model(example)
    fmt = load_format(next((package / "masks").glob("*.npz")))
    reference = ort.InferenceSession(inject_mask(graph, {0: fmt, 1: fmt}).SerializeToString(),
                                     providers=["CPUExecutionProvider"])
    original = ort.InferenceSession(str(example), providers=["CPUExecutionProvider"])
    feeds, real = make_inputs(graph, 3, 77, np.random.default_rng(1))
    assert not real.all()  # right padding is exercised
    out = session.run(None, feeds)[0]
    ref = reference.run(None, feeds)[0]
    err, scale, _ = compare(out, ref, real)
    assert err / scale <= 1e-2
    # the structured mask matters: the bare original is far from both
    err_orig, _, _ = compare(original.run(None, feeds)[0], ref, real)
    assert err_orig > 10 * err


def test_two_line_ort_loading(package):
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(package / LIBRARY_NAME))
    sess = ort.InferenceSession(str(package / "model.onnx"), so,
                                providers=["CPUExecutionProvider"])
    ids = np.arange(20, dtype=np.int64).reshape(1, 20)
    out = sess.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    assert out.shape == (1, 20, 128) and np.isfinite(out).all()


def test_verify_package_passes_within_bound(package):
    report = verify_package(package, provider="cpu", cases=[(2, 128), (1, 33)])
    assert report.passed and len(report.errors) == 2
    assert all(e.compared > 0 and e.max_ref > 0 for e in report.errors)
    assert report.worst.rel <= 1e-2
    long, short = report.errors
    assert long.mask_effect > 10 * long.rel  # at L=128 the BigBird mask changes the output
    assert short.mask_effect == 0.0  # at L=33 its 16-blocks with window 3 allow every pair


def test_verify_fails_against_another_model(package, tmp_path):
    other = tmp_path / "other.onnx"
    onnx.save(build_model(seed=5), str(other))
    report = verify_package(package, model=other, provider="cpu", cases=[(1, 64)])
    assert not report.passed and report.worst.rel > 1e-2


@pytest.mark.parametrize("fixture,mask,tile", [
    ("gpt2_ts_op17", "sliding:window=8", 16),
    ("bert_ts_op17", "bigbird:block=4,window=3,global=1,random=1,seed=0", 16),
    ("bert_dynamo_op23", "sliding:window=4", 16),  # the ONNX Attention op
    ("t5_dynamo_op18", "longformer:window=4,global=2", 16),
    ("vit_ts_op17", "strided:stride=4", 16),
])
def test_rewrite_of_exporter_fixtures_matches_reference(fixture, mask, tile, tmp_path):
    """The rewrite on real exporter graphs (head_dim 16: no kernels, CPU twins only)."""
    graph = load_model(FIXTURES / f"{fixture}.onnx")
    causal = any(layer.attention.causal_in_graph for layer in graph.layers)
    assert causal == fixture.startswith("gpt2")
    formats, model, emitted = rewrite_graph(graph, mask, tmp_path, max_seq_len=32, tile=tile,
                                            causal_from_graph=True)
    assert {e.family for e in emitted} >= {"attention", "gemm"}
    pkg = cpu_session(model, build_library(tmp_path))
    ref = ort.InferenceSession(inject_mask(graph, formats).SerializeToString(),
                               providers=["CPUExecutionProvider"])
    feeds, real = make_inputs(graph, 2, 29, np.random.default_rng(0))  # ViT: pixels, no length
    bare = ort.InferenceSession(str(FIXTURES / f"{fixture}.onnx"),
                                providers=["CPUExecutionProvider"])
    names = [o.name for o in ref.get_outputs()]
    for out, want, orig in zip(pkg.run(names, feeds), ref.run(names, feeds),
                               bare.run(names, feeds), strict=True):
        err, scale, n = compare(out, want, real)
        assert n > 0 and err / scale <= 1e-2, (fixture, err, scale)
        assert compare(orig, want, real)[0] > 3 * err  # the injected mask is not a no-op


def test_per_layer_and_per_head_masks(example, tmp_path):
    """A YAML spec with a layer override and per-head overrides: distinct formats, still exact."""
    spec = tmp_path / "mask.yaml"
    spec.write_text(
        "mask: {sliding: {window: 8}}\n"
        "layers:\n  '1': {longformer: {window: 4, global: 2}}\n"
        "heads:\n  '2-3': {strided: {stride: 16}}\n")
    pkg = compile_model(example, str(spec), max_seq_len=128, out_dir=tmp_path / "pkg",
                        instruments=Instruments(progress=False))
    doc = json.loads((pkg / "plan.json").read_text())
    formats = doc["mask"]["formats"]
    assert len(formats) == 2 and all(f["num_heads"] == 4 for f in formats)
    assert sorted(layer for f in formats for layer in f["layers"]) == [0, 1]
    report = verify_package(pkg, cases=[(2, 128), (3, 51)])
    assert report.passed, report.worst
