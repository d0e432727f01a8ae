"""Bad input ends in one clear line and exit code 2; external data loads."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from graphs import build

from stofc.cli import main
from stofc.errors import ModelError
from stofc.frontend import load_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _no_attention(path: Path) -> Path:
    w = numpy_helper.from_array(np.ones((8, 8), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
         helper.make_node("Relu", ["h"], ["y"], name="relu")], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 8])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _classifier_only(path: Path) -> Path:
    """MatMul + Softmax over classes: a Softmax, but no attention."""
    w = numpy_helper.from_array(np.ones((8, 4), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
         helper.make_node("Softmax", ["h"], ["y"], name="softmax", axis=-1)], "clf",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _training_mode(path: Path) -> Path:
    """A Dropout left on (the model was exported without model.eval())."""
    model = build()
    last = model.graph.node[-1]  # Identity -> y
    model.graph.initializer.extend([numpy_helper.from_array(np.array(0.1, np.float32), "ratio"),
                                    numpy_helper.from_array(np.array(True), "training")])
    model.graph.node.insert(len(model.graph.node) - 1, helper.make_node(
        "Dropout", [last.input[0], "ratio", "training"], ["dropped"], name="dropout_on"))
    last.input[0] = "dropped"
    onnx.save(model, str(path))
    return path


def _external_without_data(path: Path) -> Path:
    model = build()
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    (path.parent / "weights.bin").unlink()
    return path


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model\n" * 20)
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes((FIXTURES / "bert_ts_op17.onnx").read_bytes()[:50_000])
    dynamic = tmp_path / "dynamic_heads.onnx"
    onnx.save(build(dynamic_heads=True), str(dynamic))
    return {
        "missing": (tmp_path / "nope.onnx", "not found"),
        "directory": (tmp_path, "not a file"),
        "not_onnx": (text, "not"),
        "truncated": (truncated, "not a valid ONNX model"),
        "missing_external_data": (_external_without_data(tmp_path / "ext.onnx"),
                                  "external data"),
        "no_attention": (_no_attention(tmp_path / "mlp.onnx"), "no attention"),
        "classifier_softmax_only": (_classifier_only(tmp_path / "clf.onnx"), "no attention"),
        "dynamic_heads": (dynamic, "head count is not a constant"),
        "training_mode": (_training_mode(tmp_path / "train.onnx"), "training mode"),
    }


CASES = ["missing", "directory", "not_onnx", "truncated", "missing_external_data",
         "no_attention", "classifier_softmax_only", "dynamic_heads", "training_mode"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("json_flag", [False, True])
def test_bad_input_one_line_exit_2(tmp_path, case, json_flag):
    path, words = _bad_inputs(tmp_path)[case]
    args = ["inspect", str(path)] + (["--json"] if json_flag else [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and words in lines[0]
    assert "Traceback" not in result.output
    assert result.stdout.strip() == ""  # nothing half-written on stdout


@pytest.mark.parametrize("case", CASES)
def test_bad_input_raises_model_error(tmp_path, case):
    path, words = _bad_inputs(tmp_path)[case]
    with pytest.raises(ModelError) as err:
        load_model(path)
    assert "\n" not in str(err.value) and words in str(err.value)


def test_external_data_is_loaded(tmp_path):
    path = tmp_path / "ext.onnx"
    onnx.save(build(), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    assert (tmp_path / "weights.bin").stat().st_size > 10_000
    graph = load_model(path)
    assert len(graph.layers) == 1 and graph.layers[0].attention.num_heads == 4
    gemm = graph.layers[0].chain[0]
    weight = next(t for t in graph.model.graph.initializer if t.name == gemm.param("weight"))
    assert numpy_helper.to_array(weight).shape == (64, 64)


def test_analysis_crash_is_one_line(tmp_path, monkeypatch):
    """A graph that trips the matchers still ends in one ModelError line (exit 2)."""
    import stofc.frontend.model as model_module

    def boom(idx):
        raise KeyError("ghost")

    monkeypatch.setattr(model_module, "find_attention", boom)
    monkeypatch.delenv("STOFC_DEBUG", raising=False)
    path = tmp_path / "m.onnx"
    onnx.save(build(), str(path))
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert "cannot analyse" in line and "KeyError" in line
