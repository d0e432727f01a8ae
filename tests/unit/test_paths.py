"""Where templates and CUDA sources are found: checkout, wheel install, override."""

from __future__ import annotations

import sys

from stofc import paths


def test_source_checkout_is_used_first():
    assert (paths.templates_dir() / "attention").is_dir()
    assert (paths.cuda_dir() / "stofc" / "mma.cuh").is_file()


def test_wheel_install_finds_share_stofc(tmp_path, monkeypatch):
    package = tmp_path / "site-packages" / "stofc"
    package.mkdir(parents=True)
    share = tmp_path / "prefix" / "share" / "stofc"
    (share / "templates").mkdir(parents=True)
    monkeypatch.setattr(paths, "PACKAGE_DIR", package)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "prefix"))
    monkeypatch.delenv("STOFC_HOME", raising=False)
    assert paths.templates_dir() == share / "templates"
    assert paths.cuda_dir() == share / "cuda"


def test_stofc_home_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("STOFC_HOME", str(tmp_path))
    assert paths.project_root() == tmp_path.resolve()
