"""examples/build_model.py: a valid model, understood by the frontend, deterministic."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest

from stofc.frontend import OpKind, load_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "build_model.py"


def _example():
    spec = importlib.util.spec_from_file_location("stofc_example_build_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_model_is_understood(tmp_path):
    path = _example().main(["-o", str(tmp_path / "m.onnx"), "--layers", "3", "--hidden", "96",
                            "--heads", "6", "--seq", "64", "--vocab", "50"])
    graph = load_model(path)
    assert len(graph.layers) == 3 and graph.unsupported == ()
    assert graph.padding_mask_input == "attention_mask"
    for layer in graph.layers:
        att = layer.attention
        assert (att.num_heads, att.head_dim, att.hidden_size) == (6, 16, 96)
        assert (att.scale_form, att.mask_form, att.mask_source) == (
            "div_scores", "additive", "attention_mask")
        assert att.scale == pytest.approx(0.25)
        assert layer.norm_order == "post" and len(layer.chain) == 18
        ffn_in = next(op for op in layer.chain if op.role == "ffn_in")
        assert ffn_in.param("out_features") == 4 * 96
        assert layer.ops(OpKind.GELU)[0].param("form") == "erf"


def test_example_model_is_deterministic():
    build = _example().build_model
    a, b = build(layers=1, hidden=64, heads=2), build(layers=1, hidden=64, heads=2)
    assert a.SerializeToString() == b.SerializeToString()
    assert build(layers=1, hidden=64, heads=2, seed=1).SerializeToString() != a.SerializeToString()


def test_example_model_runs_in_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "m.onnx"
    onnx.save(_example().build_model(layers=2, hidden=64, heads=4, seq=32, vocab=40), str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(0, 40, (2, 12)).astype(np.int64)
    mask = np.ones((2, 12), np.int64)
    mask[1, 8:] = 0
    out = sess.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    assert out.shape == (2, 12, 64) and np.isfinite(out).all()
    # padding must not change the unpadded positions of a sequence
    short = sess.run(None, {"input_ids": ids[1:, :8], "attention_mask": mask[1:, :8]})[0]
    np.testing.assert_allclose(out[1, :8], short[0], rtol=1e-4, atol=1e-4)
