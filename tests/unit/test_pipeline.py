"""The pipeline driver: instruments, causal models, --tune hand-off, re-writing a package."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import onnx
import pytest

from stofc.errors import PlanError, StofcError
from stofc.kernels.attention import AttentionConfig
from stofc.masks import parse_mask
from stofc.package.load import read_plan, read_plan_document
from stofc.package.verify import verify_package
from stofc.pipeline import (
    Instruments,
    compile_model,
    normalize_dtype,
    recompile_package,
)
from stofc.targets import get_profile
from tests.unit.rewrite_helpers import with_causal

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from build_model import build_model  # noqa: E402


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model.onnx"
    onnx.save(build_model(layers=2), str(path))
    return path


def test_instruments_time_every_stage_and_dump_sources(example, tmp_path):
    ins = Instruments(progress=False, dump_dir=tmp_path / "dump")
    compile_model(example, "sliding:window=8", max_seq_len=64, out_dir=tmp_path / "pkg",
                  instruments=ins)
    names = [n for n, _ in ins.timings]
    assert names[:3] == ["target", "parse mask", "load model"]
    assert names[3:] == ["read the model's masks", "encode masks", "plan", "lower",
                         "render kernels", names[8], "write package"]
    assert names[8].startswith("compile (")
    assert all(t >= 0 for _, t in ins.timings)
    dumped = {p.stem for p in (tmp_path / "dump").glob("*.cu")}
    packaged = {p.stem for p in (tmp_path / "pkg" / "kernels").glob("*.cu")}
    assert dumped == packaged and any(n.startswith("stofc_attn_") for n in dumped)


def test_dtype_names():
    assert normalize_dtype("fp16") == "float16" and normalize_dtype("BF16") == "bfloat16"
    with pytest.raises(PlanError, match="fp32"):
        normalize_dtype("fp32")


def test_with_causal_sets_every_node():
    spec = with_causal(parse_mask("sliding:window=8"))
    assert json.loads(spec.canonical())["mask"]["sliding"]["causal"] is True
    already = parse_mask("sliding:window=8,causal=true")
    assert with_causal(already) == already


def test_tune_reports_the_tuner_honestly(example, tmp_path, monkeypatch):
    """--tune tunes the plan before the package is written; the tuner's refusal is one line,
    and the untuned package is written (once)."""
    monkeypatch.setattr("stofc.tune.device.check_gpu", lambda name: get_profile(name))
    with pytest.raises(StofcError) as info:
        compile_model(example, "causal", max_seq_len=64, out_dir=tmp_path / "pkg", tune=True,
                      instruments=Instruments(progress=False),
                      tune_options={"db": tmp_path / "tune.sqlite"})
    text = str(info.value)
    assert "\n" not in text and "--tune failed" in text and str(tmp_path / "pkg") in text
    assert (tmp_path / "pkg" / "manifest.json").is_file()


def test_recompile_package_with_a_new_plan(example, tmp_path):
    pkg = compile_model(example, "longformer:window=8,global=2", max_seq_len=128,
                        out_dir=tmp_path / "pkg", instruments=Instruments(progress=False))
    plan = read_plan(pkg)
    layers = []
    for lp in plan.layers:
        segs = []
        for seg in lp.segments:
            if seg.family == "attention":  # what a tuner would pick instead: row-wise
                cfg = AttentionConfig("row", 64, 2, 4)
                params = dict(seg.kernel.params)
                params.update(kind=cfg.kind, tile=cfg.tile, warp_m=cfg.warp_m, warps=cfg.warps,
                              stages=cfg.stages, q_split=cfg.q_split, gather=cfg.gather)
                seg = replace(seg, kernel=replace(seg.kernel, params=tuple(params.items())))
            elif seg.kernel.template == "vendor/cublas":
                params = dict(seg.kernel.params)
                params.update(tpr=64, rows=2)
                seg = replace(seg, kernel=replace(seg.kernel, params=tuple(params.items())))
            segs.append(seg)
        layers.append(replace(lp, segments=tuple(segs)))
    recompile_package(pkg, replace(plan, layers=tuple(layers)),
                      instruments=Instruments(progress=False))
    doc = json.loads((pkg / "plan.json").read_text())
    assert doc["provenance"]["tuned"] is True
    assert all(a["kernel"] == "row" and a["config"]["warp_m"] == 2 for a in doc["attention"])
    assert all("_t64x2" in k or not k.startswith("stofc_add_norm")
               for k in (e["name"] for e in doc["kernels"]) if "_b_" in k)
    assert any(p.name.startswith("stofc_attn_row_") for p in (pkg / "kernels").glob("*.cubin"))
    assert verify_package(pkg, cases=[(2, 100)]).passed


@pytest.mark.parametrize("segments", [
    # (the chain of the packed graph compile uses: one qkv GEMM + bias, then attention at 2)
    # GEMM+LayerNorm after attention; the whole FFN as one GEMM+GEMM(+residual+norm) segment
    [[0, 1], [2], [3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]],
    # memory-bound Add+Norm segments between plain GEMMs; bias+GELU alone (ONNX ops)
    [[0, 1], [2], [3, 4], [5, 6], [7], [8, 9], [10, 11, 12], [13]],
])
def test_recompile_with_other_fusion_schemes(example, tmp_path, segments):
    """Every family the tuner may choose is written and still computes the same function."""
    from stofc.frontend import load_model
    from stofc.plan.build import plan_layer
    from stofc.plan.scheme import FusionScheme

    pkg = compile_model(example, "sliding:window=16", max_seq_len=64, out_dir=tmp_path / "pkg",
                        instruments=Instruments(progress=False))
    plan, masks = read_plan(pkg), read_plan_document(pkg).masks()
    graph = load_model(example, pack_projections=True)  # the package's plan was built packed
    scheme = FusionScheme.from_segments(segments)
    layers = tuple(plan_layer(layer, scheme, tokens=64, profile=get_profile("h100"),
                              dtype="float16", fmt=masks[layer.index], max_seq_len=64,
                              vendor=False)
                   for layer in graph.layers)
    recompile_package(pkg, replace(plan, layers=layers), instruments=Instruments(progress=False))
    doc = json.loads((pkg / "plan.json").read_text())
    families = {s["family"] for s in doc["segments"]}
    assert families >= {"attention", "gemm"} and families & {"gemm_gemm", "gemm_norm", "add_norm"}
    assert verify_package(pkg, cases=[(2, 64), (1, 23)]).passed
