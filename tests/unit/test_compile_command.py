"""``stofc compile`` / ``verify`` / ``bench`` on the command line: success and one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from stofc.cli import main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from build_model import build_model  # noqa: E402


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "tiny.onnx"
    onnx.save(build_model(layers=1), str(path))
    return path


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.lower().startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.output  # after progress lines
    assert "Traceback" not in result.output
    return errors[0]


def test_compile_default_output_dir(example):
    result = run("compile", str(example), "--mask", "longformer:window=8,global=2",
                 "--max-seq-len", "64", "--quiet")
    assert result.exit_code == 0, result.output
    out = example.with_name("tiny.stofc")
    assert f"wrote {out}" in result.output
    assert (out / "manifest.json").is_file()
    doc = json.loads((out / "plan.json").read_text())
    assert doc["gpu"]["name"] == "h100" and doc["plan"]["dtype"] == "float16"
    assert doc["targets"] == ["sm_90", "compute_90"]


def test_compile_and_verify(example, tmp_path):
    out = tmp_path / "pkg"
    result = run("compile", str(example), "--mask", "causal", "--max-seq-len", "64",
                 "-o", str(out), "--gpu", "h200", "--dump-dir", str(tmp_path / "dump"))
    assert result.exit_code == 0, result.output
    assert list((tmp_path / "dump").glob("*.cu"))
    result = run("verify", str(out), "--seq-len", "64", "--seq-len", "31", "--batch", "3")
    assert result.exit_code == 0, result.output
    assert "ok: every output within 0.01" in result.output
    assert result.output.count("last_hidden_state") == 2
    result = run("verify", str(out), "--json", "--seq-len", "20")
    report = json.loads(result.output)
    assert report["passed"] and report["errors"][0]["seq_len"] == 20


def test_verify_exit_1_beyond_bound(example, tmp_path):
    out = tmp_path / "pkg"
    assert run("compile", str(example), "--mask", "causal", "--max-seq-len", "64", "-o",
               str(out), "--quiet").exit_code == 0
    other = tmp_path / "other.onnx"
    onnx.save(build_model(layers=1, seed=3), str(other))
    result = run("verify", str(out), "--model", str(other), "--seq-len", "32")
    assert result.exit_code == 1
    assert "verify failed: output last_hidden_state" in result.output


@pytest.mark.parametrize("args,needle", [
    (("compile", "missing.onnx", "--mask", "causal"), "model file not found"),
    (("compile", "{model}", "--mask", "nosuchmask"), "nosuchmask"),
    (("compile", "{model}", "--mask", "causal", "--gpu", "tpu9"), "unknown GPU"),
    (("compile", "{model}", "--mask", "causal", "--max-seq-len", "0"), "--max-seq-len 0"),
    (("compile", "{model}", "--mask", "causal", "--dtype", "fp8"), "fp8"),
    (("compile", "{model}", "--mask", "causal", "--tune", "--max-seq-len", "64"), "GPU"),
    (("compile", "{model}", "--mask", "causal", "--budget", "5"), "--budget 5 needs --tune"),
    (("compile", "{model}", "--mask", "causal", "--db", "{tmp}/t.db"), "--tune was not given"),
    (("compile", "{model}", "--mask", "causal", "--max-seq-len", "64", "--seq-len", "128"),
     "--seq-len 128 is outside 1..64"),
    (("compile", "{model}", "--mask", "causal", "--tune", "--max-seq-len", "64", "--seq-len",
      "128"), "--seq-len 128 is outside 1..64"),
    (("verify", "{tmp}/nowhere"), "does not exist"),
    (("verify", "{tmp}", "--batch", "2"), "--batch without --seq-len"),
    (("bench", "{tmp}"), "onnxruntime-gpu"),
])
def test_bad_inputs_exit_2_with_one_line(args, needle, example, tmp_path):
    args = tuple(a.format(model=example, tmp=tmp_path) for a in args)
    line = one_error_line(run(*args))
    assert needle in line


def test_compile_refuses_foreign_output(example, tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    line = one_error_line(run("compile", str(example), "--mask", "causal", "-o", str(tmp_path)))
    assert "not a stofc package" in line
    assert (tmp_path / "keep.txt").is_file()


def test_compile_bf16_then_verify_on_cpu_passes(example, tmp_path):
    out = tmp_path / "bf16"
    result = run("compile", str(example), "--mask", "causal", "--dtype", "bf16",
                 "--max-seq-len", "64", "-o", str(out), "--quiet")
    assert result.exit_code == 0, result.output
    result = run("verify", str(out))                   # the CPU twins run bfloat16 too
    assert result.exit_code == 0, result.output


def test_bench_table_json_and_plot_formatting(tmp_path, monkeypatch):
    """The bench command's own logic (pairing, speed-up, JSON, PNG) on given timings.

    The timings here are inputs to the formatting, not measurements: measuring
    needs onnxruntime-gpu and a GPU (see test_bad_inputs_exit_2_with_one_line).
    """
    from stofc.package.bench import BenchResult, Timing

    def given(package, *, model, cases, warmup, repeat, cuda_graph):
        assert not cuda_graph
        return BenchResult([t for b, n in cases for t in (
            Timing("stofc", b, n, 1.0 * b, 0.9, 1.1),
            Timing("ort-optimized", b, n, 3.0 * b, 2.9, 3.1))], [])

    monkeypatch.setattr("stofc.commands.bench.bench_package", given)
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = run("bench", str(tmp_path), "--batch", "1", "--seq-len", "128", "--batch", "4",
                 "--seq-len", "2048", "--json-out", str(out), "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert "3.00x" in result.output and "2048" in result.output
    summary = json.loads(out.read_text())["summary"]
    assert [(r["batch"], r["seq_len"]) for r in summary] == [(1, 128), (4, 2048)]
    assert all(abs(r["speedup"] - 3.0) < 1e-9 for r in summary)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cuda_graph_table_marks_refusals_and_keeps_both_tables(tmp_path, monkeypatch):
    """--cuda-graph: a second table from the graph timings; a side ORT refused to capture
    falls back to its plain time with a footnote naming ORT's reason (given timings)."""
    from stofc.package.bench import BenchResult, Refusal, Timing

    def given(package, *, model, cases, warmup, repeat, cuda_graph):
        assert cuda_graph and cases == [(1, 128), (4, 2048)]
        plain = [Timing(name, b, n, ms * b, 0.0, 0.0) for b, n in cases
                 for name, ms in (("stofc", 1.0), ("ort-optimized", 3.0))]
        graph = [Timing("stofc", 1, 128, 0.5, 0.0, 0.0, graph=True),
                 Timing("ort-optimized", 1, 128, 0.6, 0.0, 0.0, graph=True),
                 Timing("stofc", 4, 2048, 2.0, 0.0, 0.0, graph=True)]
        return BenchResult(plain + graph, [Refusal("ort-optimized", 4, 2048, "nodes on CPU")])

    monkeypatch.setattr("stofc.commands.bench.bench_package", given)
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = run("bench", str(tmp_path), "--batch", "1", "--seq-len", "128", "--batch", "4",
                 "--seq-len", "2048", "--cuda-graph", "--json-out", str(out), "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert "CUDA graphs" in result.output
    assert "[1] ort-optimized at B=4 L=2048: ONNX Runtime refused CUDA-graph capture " \
        "(nodes on CPU); its plain time is used" in result.output
    doc = json.loads(out.read_text())
    assert [r["speedup"] for r in doc["summary"]] == [3.0, 3.0]
    small, large = doc["cuda_graph"]
    assert (small["stofc_ms"], small["ort_optimized_ms"]) == (0.5, 0.6)
    assert small["stofc_graph"] and small["ort_optimized_graph"]
    assert (large["stofc_ms"], large["ort_optimized_ms"]) == (2.0, 12.0)   # ORT: plain
    assert large["stofc_graph"] and not large["ort_optimized_graph"]
    assert abs(large["speedup"] - 6.0) < 1e-12
    assert doc["refusals"] == [{"name": "ort-optimized", "batch": 4, "seq_len": 2048,
                                "reason": "nodes on CPU"}]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_graph_replay_check_rejects_a_different_or_non_finite_output():
    from stofc.package.bench import GRAPH_TOLERANCE, relative_difference

    ref = np.array([[1.0, -2.0], [0.5, 4.0]], np.float64)
    assert relative_difference(ref.copy(), ref) == 0.0
    assert relative_difference(ref + 4e-3, ref) == pytest.approx(1e-3, rel=1e-12)  # / max|ref|
    assert relative_difference(ref + 8e-3, ref) > GRAPH_TOLERANCE
    nan = ref.copy()
    nan[0, 0] = np.nan
    assert relative_difference(nan, ref) == float("inf")
