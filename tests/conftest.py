"""Test-session isolation: no test writes into the user's real stofc cache.

``pytest_configure`` runs before any test module is imported, so every test,
every module-scoped fixture and every subprocess a test starts (they inherit
``os.environ``) sees:

* ``STOFC_CACHE_DIR``: a fresh temporary directory for this session (compiled
  kernels, the custom-op library cache ``ortlib/``, ``ort-headers/``, the
  tuning database, locks), removed when the session ends;
* ``STOFC_DUMP_DIR``: where a failed NVRTC compile dumps its source, under the
  same directory (the default is a shared ``/tmp/stofc-dump``);
* ``CUPY_CACHE_DIR``: CuPy's kernel cache (default ``~/.cupy/kernel_cache``), which
  importing CuPy's NVRTC binding creates.

``~/.cache/stofc`` (or ``$XDG_CACHE_HOME/stofc``) is never consulted:
``stofc.paths.cache_dir`` reads ``STOFC_CACHE_DIR`` first.
``tests/unit/test_cache_isolation.py`` checks this, and ``.ci/run`` compares a
listing of the real cache before and after ``make test``.

A test that needs a cache of its own still sets ``STOFC_CACHE_DIR`` with
``monkeypatch``; it is restored to the session directory afterwards.

Fixtures shared by the whole session: the C++ test programs are built once per session
(once per worker under ``pytest -n``), not once per module that uses them:

* ``fake``: the fake-GPU custom-op library: a test build of ``libstofc_ort.so``
  (``-DSTOFC_CUDA_TWINS_ON_CPU``, :func:`stofc.package.ortlib.build_test_library`) and
  ``cuda/ort/tests/fake_cuda.cc`` as ``libcuda.so.1`` / cuBLASLt beside it (see
  tests/unit/test_ortlib_fake_gpu.py);
* ``driver``: ``cuda/ort/tests/attrs_test.cc``, the attribute parser's test driver
  (tests/unit/test_ortlib_cuda.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from stofc.package.ort_headers import find_ort_headers
from stofc.package.ortlib import build_test_library, cuda_include_dir, sources_dir

_SESSION: dict[str, str | None] = {}
ISOLATED_ENV = ("STOFC_CACHE_DIR", "STOFC_DUMP_DIR", "CUPY_CACHE_DIR")


def pytest_configure(config) -> None:
    root = Path(tempfile.mkdtemp(prefix="stofc-test-session-"))
    _SESSION["root"] = str(root)
    for name in ISOLATED_ENV:
        _SESSION[name] = os.environ.get(name)
    os.environ["STOFC_CACHE_DIR"] = str(root / "cache")
    os.environ["STOFC_DUMP_DIR"] = str(root / "dump")
    os.environ["CUPY_CACHE_DIR"] = str(root / "cupy")


def pytest_unconfigure(config) -> None:
    root = _SESSION.pop("root", None)
    for name in ISOLATED_ENV:
        old = _SESSION.pop(name, None)
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
    if root:
        shutil.rmtree(root, ignore_errors=True)


def session_root() -> Path:
    """The temporary directory holding this session's cache and dumps."""
    return Path(_SESSION["root"] or "")


@pytest.fixture(scope="session")
def fake(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fakegpu")
    lib = build_test_library(root / "lib", ("STOFC_CUDA_TWINS_ON_CPU",))
    fake_so = root / "libfakecuda.so"
    res = subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-Wall", "-Werror",
                          "-I", str(sources_dir()), "-I", str(cuda_include_dir()),
                          str(sources_dir() / "tests" / "fake_cuda.cc"), "-o", str(fake_so)],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    (root / "libcuda.so.1").symlink_to(fake_so)
    return {"lib": lib, "dir": root, "fake": fake_so}


@pytest.fixture(scope="session")
def driver(tmp_path_factory) -> Path:
    src = sources_dir()
    exe = tmp_path_factory.mktemp("attrs") / "attrs_test"
    cmd = ["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-I", str(src),
           "-I", str(find_ort_headers(None).include_dir), "-I", str(cuda_include_dir()),
           str(src / "tests" / "attrs_test.cc"), str(src / "cuda_attrs.cc"),
           str(src / "launch_plan.cc"), "-o", str(exe)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    return exe
