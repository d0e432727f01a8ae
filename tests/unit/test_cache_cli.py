"""`stofc cache status|clear` over a temporary cache directory."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from stofc.cli import main
from stofc.tune.db import RecordKey, Sample, TuningDatabase


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("STOFC_CACHE_DIR", str(root))
    kernels = root / "kernels" / "ab"
    kernels.mkdir(parents=True)
    (kernels / "abc.cubin").write_bytes(b"x" * 1000)
    (kernels / "abd.ptx").write_bytes(b"y" * 500)
    with TuningDatabase.open(root / "tuning.sqlite") as db:
        for gpu, n in (("NVIDIA H200", 3), ("NVIDIA H100 80GB HBM3", 2)):
            for i in range(n):
                key = RecordKey("gemm", f"[{i}]", gpu, "580", "[]")
                db.upsert_best(key, '{"b":1}', 1.0)
                db.add_samples(key, [Sample('{"b":1}', 1.0, None), Sample('{"b":2}', None, "x")])
    return root


def invoke(*args: str):
    return CliRunner().invoke(main, ["cache", *args])


def test_status_reports_locations_sizes_and_counts_per_gpu(cache):
    result = invoke("status")
    assert result.exit_code == 0, result.output
    assert f"cache directory: {cache}" in result.output
    assert "2 files, 1.5 KiB" in result.output
    assert "5 records" in result.output
    assert "NVIDIA H200: 3 records, 6 samples" in result.output
    assert "NVIDIA H100 80GB HBM3: 2 records, 4 samples" in result.output
    info = json.loads(invoke("status", "--json").output)
    assert info["kernels"]["files"] == 2 and info["kernels"]["bytes"] == 1500
    assert info["tuning"]["gpus"]["NVIDIA H200"] == {"records": 3, "samples": 6}


def test_status_does_not_create_a_database(tmp_path, cache):
    other = tmp_path / "other.sqlite"
    result = invoke("status", "--db", str(other))
    assert result.exit_code == 0 and "not created yet" in result.output
    assert not other.exists()


def test_clear_needs_confirmation(cache):
    result = invoke("clear")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: not clearing the compiled kernels, custom-op libraries, ONNX Runtime headers "
        "and tuning records without confirmation; add --yes to delete them"]
    assert (cache / "kernels").is_dir()


def test_clear_tuning_for_one_gpu_then_kernels(cache):
    result = invoke("clear", "--tuning", "--gpu", "h100", "--yes")
    assert result.exit_code == 0, result.output
    assert "6 rows" in result.output
    with TuningDatabase.open(cache / "tuning.sqlite") as db:
        assert db.counts_by_gpu() == {"NVIDIA H200": (3, 6)}
    assert (cache / "kernels").is_dir()
    result = invoke("clear", "--kernels", "--yes")
    assert result.exit_code == 0 and "2 files" in result.output
    assert not (cache / "kernels").exists()
    with TuningDatabase.open(cache / "tuning.sqlite") as db:
        assert db.counts_by_gpu() == {"NVIDIA H200": (3, 6)}


def test_clear_everything(cache):
    result = invoke("clear", "--yes")
    assert result.exit_code == 0, result.output
    assert not (cache / "kernels").exists()
    with TuningDatabase.open(cache / "tuning.sqlite") as db:
        assert db.counts_by_gpu() == {}


def test_clear_rejects_gpu_with_kernels_and_unknown_gpu(cache):
    result = invoke("clear", "--kernels", "--gpu", "h100", "--yes")
    assert result.exit_code == 2 and "--gpu selects tuning records" in result.output
    result = invoke("clear", "--tuning", "--gpu", "v100", "--yes")
    assert result.exit_code == 2 and "unknown GPU 'v100'" in result.output
