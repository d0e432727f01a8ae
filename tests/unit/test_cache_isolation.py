"""Issue 16: tests never write into the user's real cache (``make test`` once added 208
files to ``~/.cache/stofc``). ``tests/conftest.py`` points STOFC_CACHE_DIR (and the NVRTC
dump directory) at a temporary directory for the whole session; ``.ci/run`` also compares
a listing of the real cache before and after ``make test``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from stofc.paths import cache_dir
from tests.conftest import session_root

ROOT = Path(__file__).resolve().parents[2]


def test_the_session_cache_is_temporary_and_not_the_users():
    root = session_root()
    assert root.is_dir() and root != Path()
    assert cache_dir() == root / "cache"
    real = Path.home() / ".cache" / "stofc"
    assert real not in (cache_dir(), *cache_dir().parents)
    assert os.environ["STOFC_DUMP_DIR"] == str(root / "dump")


def test_a_subprocess_writes_the_session_cache_not_home(tmp_path):
    """A child process (as tests start them) inherits the session cache: with HOME and
    XDG_CACHE_HOME pointing at an empty directory, a compile that fills the kernel cache
    leaves that directory empty."""
    home = tmp_path / "home"
    home.mkdir()
    value = os.getpid()  # a source no other test compiles: a cache miss, so a write
    code = ("from stofc.codegen import Source\n"
            "from stofc.compile import compile_source\n"
            "from stofc.paths import cache_dir\n"
            "src = Source('isolation_probe', 'extern \"C\" __global__ void probe_iso(int* p) "
            f"{{ p[0] = {value}; }}', 'inline', ('probe_iso',))\n"
            "k = compile_source(src, 'sm_80')\n"
            "print(cache_dir())\n")
    env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(ROOT),
                         capture_output=True, text=True, check=False, timeout=300)
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()) == cache_dir()
    assert list(home.rglob("*")) == []
    assert list((cache_dir() / "kernels").rglob("*.cubin.entry"))
