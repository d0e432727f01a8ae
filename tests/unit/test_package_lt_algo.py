"""Tuned cuBLASLt ranks reach the package's FusedGemm nodes (``lt_algo_m`` / ``lt_algo_rank``)."""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
from onnx import helper

from stofc.package.load import read_plan
from stofc.pipeline import Instruments, compile_model, recompile_package
from tests.unit.rewrite_helpers import with_lt_rank

ROOT = Path(__file__).resolve().parents[2]


def test_tuned_ranks_become_fused_gemm_attributes(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    from build_model import build_model
    model = tmp_path / "m.onnx"
    onnx.save(build_model(layers=1), str(model))
    pkg = compile_model(model, "causal", max_seq_len=128, out_dir=tmp_path / "pkg",
                        instruments=Instruments(progress=False))
    gemms = [n for n in onnx.load(str(pkg / "model.onnx")).graph.node if n.op_type == "FusedGemm"]
    assert gemms and not any(a.name.startswith("lt_algo") for n in gemms for a in n.attribute)
    plan = read_plan(pkg)
    vendor = [s for lp in plan.layers for s in lp.segments if s.kernel.template == "vendor/cublas"]
    assert vendor, "the analytical plan runs its GEMMs on cuBLASLt"
    big, small = with_lt_rank(plan, 3, 256), with_lt_rank(plan, 5, 64)
    recompile_package(pkg, big, buckets=((32, small), (128, big)),
                      instruments=Instruments(progress=False))
    model_out = onnx.load(str(pkg / "model.onnx"))
    ranked = {n.name: {a.name: helper.get_attribute_value(a) for a in n.attribute}
              for n in model_out.graph.node if n.op_type == "FusedGemm"}
    with_rank = {k: v for k, v in ranked.items() if "lt_algo_m" in v}
    # every FusedGemm running one vendor segment's GEMM gets both buckets' (M, rank)
    # pairs sorted by M; the packed Q|K|V node too: compile packs the projections in the
    # graph (stofc.frontend.pack), so its segment is the qkv GEMM of width 3N it runs
    assert with_rank
    for attrs in with_rank.values():
        assert attrs["lt_algo_m"] == [64, 256] and attrs["lt_algo_rank"] == [5, 3]
    packed = [next(n.name for n in model_out.graph.node if sa.input[0] in n.output)
              for sa in model_out.graph.node if sa.op_type == "SparseAttention"]
    assert packed and all(k in with_rank for k in packed)
