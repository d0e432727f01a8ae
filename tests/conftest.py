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
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

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
