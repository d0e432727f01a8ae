"""``stofc bench`` at long lengths without a GPU: fresh sessions per case with their peak
memory, ORT failing a long case recorded (not fatal), the package's own limit checked first,
and the table printing memory and failures. ONNX Runtime's CUDA sessions and the timing are
replaced by fakes; what is tested is the bench's own logic on their results."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnxruntime
import pytest
from click.testing import CliRunner

import stofc.package.bench as B
from stofc.cli import main
from stofc.errors import StofcError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    from stofc.pipeline import Instruments, compile_model

    return compile_model(FIXTURES / "modernbert_ts_op17.onnx", "model", gpu="h100",
                         max_seq_len=256, out_dir=tmp_path_factory.mktemp("p") / "mb.stofc",
                         instruments=Instruments(progress=False))


class FakeSession:
    def __init__(self, side: str, providers):
        self.side, self.providers = side, providers

    def get_outputs(self):
        return [SimpleNamespace(name="last_hidden_state")]

    def run(self, names, feeds):
        b, s = feeds["input_ids"].shape
        return [np.zeros((b, s, 64), np.float32)]


def fake_runtime(monkeypatch, *, fail_ort_at: int | None = None, fail_stofc: bool = False):
    """Fakes for the CUDA parts; returns the list of sessions opened and the memory reads."""
    opened, reads = [], iter(range(0, 10**12, 100 * 2**20))   # +100 MiB per read
    monkeypatch.setattr(B, "require_cuda", lambda: None)
    monkeypatch.setattr(B, "optimized_baseline", lambda graph, source, work: Path(source))
    monkeypatch.setattr(B, "device_memory_used", lambda: next(reads))

    def session(side):
        def make(path, providers):
            opened.append(FakeSession(side, providers))
            return opened[-1]
        return make

    monkeypatch.setattr(B, "load", session("stofc"))
    monkeypatch.setattr(onnxruntime, "InferenceSession", session("ort"))

    def timed(sess, feeds, *, warmup, repeat):
        s = feeds["input_ids"].shape[1]
        if sess.side == "ort" and s == fail_ort_at:
            raise RuntimeError("CUDA failure 2: out of memory ; GPU=0\nstack")
        if sess.side == "stofc" and fail_stofc:
            raise RuntimeError("kernel launch failed")
        return (1.0, 0.9, 1.1) if sess.side == "stofc" else (3.0, 2.9, 3.1)

    monkeypatch.setattr(B, "time_session", timed)
    return opened


def test_fresh_session_per_case_with_memory_and_ort_failure_recorded(package, monkeypatch):
    opened = fake_runtime(monkeypatch, fail_ort_at=256)
    result = B.bench_package(package, model=None, cases=[(1, 128), (1, 256)])
    assert [(t.name, t.seq_len, t.median_ms, t.peak_mib) for t in result.timings] == [
        ("stofc", 128, 1.0, 100.0), ("ort-optimized", 128, 3.0, 100.0),
        ("stofc", 256, 1.0, 100.0)]
    assert result.failures == (B.Refusal("ort-optimized", 1, 256, "CUDA failure 2: out of "
                                         "memory ; GPU=0"),)
    assert [s.side for s in opened] == ["stofc", "ort", "stofc", "ort"]   # one per case
    assert all(s.providers == B.memory_providers() for s in opened)
    assert B.memory_providers()[0] == (B.CUDA_EP, {"arena_extend_strategy": "kSameAsRequested"})


def test_package_failure_is_an_error_and_its_limit_is_checked_first(package, monkeypatch):
    fake_runtime(monkeypatch, fail_stofc=True)
    with pytest.raises(StofcError, match="failed running stofc at batch 1, length 128"):
        B.bench_package(package, model=None, cases=[(1, 128)])
    with pytest.raises(StofcError, match="--seq-len 32768 exceeds the package's max_seq_len 256"
                       ) as err:
        B.bench_package(package, model=None, cases=[(1, 128), (1, 32768)])
    assert "--max-seq-len 32768" in err.value.hint


def test_memory_unreadable_gives_none(package, monkeypatch):
    fake_runtime(monkeypatch)
    monkeypatch.setattr(B, "device_memory_used", lambda: None)
    result = B.bench_package(package, model=None, cases=[(1, 64)])
    assert [t.peak_mib for t in result.timings] == [None, None]


def test_table_prints_memory_and_failures(tmp_path, monkeypatch):
    """Given timings (inputs to the formatting): MiB columns, 'failed [1]' with ORT's reason."""
    def given(package, *, model, cases, warmup, repeat, cuda_graph):
        return B.BenchResult(
            [B.Timing("stofc", 1, 8192, 5.0, 4.9, 5.1, peak_mib=900.0),
             B.Timing("ort-optimized", 1, 8192, 10.0, 9.9, 10.1, peak_mib=3000.0),
             B.Timing("stofc", 1, 32768, 20.0, 19.9, 20.1, peak_mib=2100.0)], [],
            (B.Refusal("ort-optimized", 1, 32768, "CUDA failure 2: out of memory"),))

    monkeypatch.setattr("stofc.commands.bench.bench_package", given)
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", str(tmp_path), "--batch", "1", "--seq-len",
                                       "8192", "--batch", "1", "--seq-len", "32768",
                                       "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["B", "L", "stofc", "ms", "ORT", "opt", "ms", "speed-up",
                                "stofc", "MiB", "ORT", "MiB"]
    assert lines[1].split() == ["1", "8192", "5.000", "10.000", "2.00x", "900", "3000"]
    assert lines[2].split() == ["1", "32768", "20.000", "failed", "[1]", "-", "2100", "-"]
    assert "[1] ort-optimized at B=1 L=32768: ONNX Runtime failed (CUDA failure 2: out of " \
        "memory)" in result.output
    doc = json.loads(out.read_text())
    assert doc["summary"][1] == {"batch": 1, "seq_len": 32768, "stofc_ms": 20.0,
                                 "stofc_graph": False, "stofc_peak_mib": 2100.0,
                                 "ort_optimized_ms": None, "ort_optimized_graph": False,
                                 "ort_optimized_peak_mib": None, "speedup": None}
    assert doc["failures"] == [{"name": "ort-optimized", "batch": 1, "seq_len": 32768,
                                "reason": "CUDA failure 2: out of memory"}]
    assert doc["timings"][0]["peak_mib"] == 900.0
