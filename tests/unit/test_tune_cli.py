"""`stofc tune` argument checks: one line, exit code 2, before anything is measured."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import stofc.tune.device as device
from stofc.cli import main


@pytest.fixture
def package(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "plan.json").write_text("{}")
    return pkg


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STOFC_CACHE_DIR", str(tmp_path / "cache"))


def run(*args: str):
    result = CliRunner().invoke(main, ["tune", *args])
    lines = result.output.strip().splitlines()
    return result.exit_code, lines


def one_error_line(code: int, lines: list[str]) -> str:
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def with_gpu(monkeypatch, name: str | None) -> None:
    monkeypatch.setattr(device, "present_gpu_name", lambda: name)


def test_unknown_gpu(package, monkeypatch):
    with_gpu(monkeypatch, "NVIDIA H200")
    line = one_error_line(*run(str(package), "--gpu", "v100"))
    assert "unknown GPU 'v100'" in line and "h200" in line


def test_gpu_mismatch_names_both(package, monkeypatch):
    with_gpu(monkeypatch, "NVIDIA H200")
    line = one_error_line(*run(str(package), "--gpu", "h100"))
    assert "--gpu h100" in line and "NVIDIA H100" in line and "NVIDIA H200 (h200)" in line
    assert "--gpu h200" in line


def test_no_gpu_at_all(package, monkeypatch):
    with_gpu(monkeypatch, None)
    for name in ("h100", "auto"):
        line = one_error_line(*run(str(package), "--gpu", name))
        assert "no CUDA GPU was found" in line


def test_gpu_without_profile(package, monkeypatch):
    with_gpu(monkeypatch, "Tesla T4")
    line = one_error_line(*run(str(package), "--gpu", "auto"))
    assert "'Tesla T4', has no stofc profile" in line


def test_missing_package_dir(tmp_path, monkeypatch):
    with_gpu(monkeypatch, "NVIDIA H200")
    line = one_error_line(*run(str(tmp_path / "nope"), "--gpu", "h200"))
    assert "does not exist" in line


def test_package_without_plan(tmp_path, monkeypatch):
    with_gpu(monkeypatch, "NVIDIA H200")
    line = one_error_line(*run(str(tmp_path), "--gpu", "h200"))
    assert "has no plan.json" in line


def test_default_package_is_the_current_directory(tmp_path, monkeypatch):
    with_gpu(monkeypatch, "NVIDIA H200")
    monkeypatch.chdir(tmp_path)
    line = one_error_line(*run("--gpu", "h200"))
    assert ". has no plan.json" in line


@pytest.mark.parametrize("args, text", [
    (["--budget", "0"], "--budget 0 is not positive"),
    (["--batch", "0"], "--batch 0 is not positive"),
    (["--seq-len", "128", "--seq-len", "-4"], "--seq-len -4 is not positive"),
])
def test_numbers_are_checked(package, monkeypatch, args, text):
    with_gpu(monkeypatch, "NVIDIA H200")
    line = one_error_line(*run(str(package), "--gpu", "h200", *args))
    assert text in line


def test_passing_checks_reach_the_package_tuner_which_reads_plan_json(package, tmp_path,
                                                                      monkeypatch):
    with_gpu(monkeypatch, "NVIDIA H200")
    db = tmp_path / "t.sqlite"
    line = one_error_line(*run(str(package), "--gpu", "auto", "--db", str(db), "--quiet",
                               "--seq-len", "512", "--seq-len", "128"))
    assert "no manifest.json" in line   # tune_package checks the manifest before plan.json
    assert db.is_file()  # the database was opened (and created) before the package step
