"""A float16 GEMM+norm segment adds its residual in the GEMM, not in the norm.

The scheme long inputs get by default (the norm fused into the GEMM's segment from
``NORM_ROW_TILE * SMs`` tokens on) used to be written as ``FusedGemm(x, w, b)`` then
``AddLayerNorm(y, residual)``, so the norm, a memory pass, read two tensors. Now
(:func:`stofc.lower.emitters._residual_in_gemm`) the residual is FusedGemm's fourth input
(cuBLASLt's C with beta = 1) and the norm reads one:

* every AddLayerNorm fed by a FusedGemm in such a segment has no residual, and that
  FusedGemm has one (the attention block's and the FFN's);
* the package computes the model: verified on ONNX Runtime's CPU EP within the bound;
* the bfloat16 package of the same plan keeps the residual in the norm (its pre-LN sum stays
  float32, ``stofc.lower.prenorm``).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import onnx
import pytest

from stofc.frontend import load_model
from stofc.package.load import read_plan_document
from stofc.package.verify import verify_package
from stofc.pipeline import Instruments, compile_model, recompile_package
from stofc.plan.build import plan_layer
from stofc.plan.scheme import FusionScheme
from stofc.targets import get_profile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from build_model import build_model  # noqa: E402

QUIET = Instruments(progress=False)
DOMAIN = "ai.stofc"
# QKV, attention, out-projection + bias + residual + norm (gemm_norm), FFN + norm (gemm_gemm)
SCHEME = [[0, 1], [2], [3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]]
pytestmark = pytest.mark.slow


def _package(tmp_path: Path, dtype: str) -> tuple[Path, Path]:
    model = tmp_path / "model.onnx"
    onnx.save(build_model(layers=2), str(model))
    pkg = compile_model(model, "sliding:window=16", max_seq_len=64, out_dir=tmp_path / "pkg",
                        dtype="fp16" if dtype == "float16" else "bf16", instruments=QUIET)
    doc = read_plan_document(pkg)
    masks = doc.masks()
    layers = tuple(plan_layer(layer, FusionScheme.from_segments(SCHEME), tokens=64,
                              profile=get_profile("h100"), dtype=dtype,
                              fmt=masks[layer.index], max_seq_len=64, vendor=True)
                   for layer in load_model(model, pack_projections=True).layers)
    recompile_package(pkg, replace(doc.plan, layers=layers), instruments=QUIET)
    return pkg, model


def _norms_after_gemms(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, onnx.NodeProto]]:
    producers = {out: n for n in model.graph.node for out in n.output}
    pairs = []
    for norm in model.graph.node:
        if norm.domain == DOMAIN and norm.op_type == "AddLayerNorm":
            gemm = producers.get(norm.input[0])
            if gemm is not None and gemm.domain == DOMAIN and gemm.op_type == "FusedGemm":
                pairs.append((gemm, norm))
    return pairs


def test_fp16_gemm_norm_adds_the_residual_in_the_gemm(tmp_path):
    pkg, model = _package(tmp_path, "float16")
    pairs = _norms_after_gemms(onnx.load(str(pkg / "model.onnx")))
    assert len(pairs) == 4                                  # 2 layers x (attention, FFN)
    for gemm, norm in pairs:
        assert len(gemm.input) == 4 and gemm.input[3], gemm.name   # the residual: cuBLASLt's C
        assert len(norm.input) < 2 or norm.input[1] == "", norm.name
        assert len(norm.output) == 1                        # no pre-norm sum to write
    plan_text = (pkg / "plan.json").read_text()
    assert plan_text.count("residual added by the GEMM") == 4   # the segments' notes say so
    report = verify_package(pkg, model=model, cases=[(2, 64)])
    assert report.passed, report.to_dict()


def test_bf16_gemm_norm_keeps_the_residual_in_the_norm(tmp_path):
    pkg, _ = _package(tmp_path, "bfloat16")
    pairs = _norms_after_gemms(onnx.load(str(pkg / "model.onnx")))
    assert len(pairs) == 4
    for gemm, norm in pairs:
        assert len(gemm.input) == 3, gemm.name              # x, w, the float32 bias
        assert norm.input[1], norm.name                      # the residual, added in float32
