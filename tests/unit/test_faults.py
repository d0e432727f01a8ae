"""Fault injection (issue 16): read-only and full file systems, damaged cache entries,
signals and kill -9 in the middle of a compile or a library build, concurrent compiles.

Every fault must end in one ``error: <problem>; <fix>`` line with exit code 2 (or the
signal's code), leave no temporary file behind (or one the next run removes), never
package a damaged cache entry, and never leave a compiler process running.

Two kinds of file-system faults: monkeypatched ones (every machine; the OS error a
read-only or full file system gives, raised where stofc writes) and real ones on a
small tmpfs in a private mount namespace (``unshare -rm``; skipped where user
namespaces are not available).
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

import stofc
from stofc import cachecheck
from stofc.cli import main
from stofc.paths import cache_dir
from stofc.pipeline import Instruments, compile_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from build_model import build_model  # noqa: E402

MASK = "sliding:window=16"
L = "64"


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model.onnx"
    onnx.save(build_model(layers=1), str(path))
    compile_model(path, MASK, max_seq_len=64, out_dir=path.parent / "warm",
                  instruments=Instruments(progress=False))  # the session cache is warm now
    return path


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(cachecheck, "_warned", set())


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def one_error_line(result, code: int = 2) -> str:
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), result.output
    assert sum(line.startswith("error: ") for line in lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[-1]


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


# ---------------------------------------------------------------- monkeypatched file systems


def fail_writes_under(monkeypatch, root: Path, code: int) -> None:
    """Every write under ``root`` fails with ``code`` (EROFS: read-only, ENOSPC: full)."""
    root = root.absolute()
    message = os.strerror(code)

    def under(path) -> bool:
        try:
            Path(os.fsdecode(path)).absolute().relative_to(root)
        except (TypeError, ValueError):
            return False
        return True

    def refuse(path):
        raise OSError(code, message, os.fsdecode(path))

    real_open, real_io_open, real_os_open = builtins.open, io.open, os.open
    real_mkdir, real_replace, real_rename = os.mkdir, os.replace, os.rename

    def fake_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") \
                and under(file):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_io_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") \
                and under(file):
            refuse(file)
        return real_io_open(file, mode, *args, **kwargs)

    def fake_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and under(path):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if under(path):
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(path))
            refuse(path)
        return real_mkdir(path, *args, **kwargs)

    def fake_move(real):
        def move(src, dst, *args, **kwargs):
            if under(src) or under(dst):
                refuse(dst)
            return real(src, dst, *args, **kwargs)
        return move

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_io_open)
    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr(os, "replace", fake_move(real_replace))
    monkeypatch.setattr(os, "rename", fake_move(real_rename))


@pytest.mark.parametrize("code,words", [(errno.EROFS, "read-only"),
                                        (errno.ENOSPC, "free disk space")])
def test_compile_into_a_read_only_or_full_place(example, tmp_path, monkeypatch, code, words):
    """Defect: a read-only -o (or parent) and a full disk gave tracebacks (exit 1)."""
    place = tmp_path / "place"
    place.mkdir()
    fail_writes_under(monkeypatch, place, code)
    line = one_error_line(run("compile", str(example), "--mask", MASK, "--max-seq-len", L,
                              "-o", str(place / "pkg"), "--quiet"))
    assert os.strerror(code) in line and words in line and str(place) in line
    monkeypatch.undo()
    assert list(place.iterdir()) == []


def test_replacing_a_package_in_a_read_only_place_keeps_it(example, tmp_path, monkeypatch):
    pkg = compile_model(example, MASK, max_seq_len=64, out_dir=tmp_path / "pkg",
                        instruments=Instruments(progress=False))
    before = {p: p.read_bytes() for p in pkg.rglob("*") if p.is_file()}
    fail_writes_under(monkeypatch, tmp_path, errno.EROFS)
    one_error_line(run("compile", str(example), "--mask", "causal", "--max-seq-len", L,
                       "-o", str(pkg), "--quiet"))
    monkeypatch.undo()
    assert {p: p.read_bytes() for p in pkg.rglob("*") if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]


def test_unwritable_cache_directory(example, tmp_path, monkeypatch):
    """Defect: an unwritable STOFC_CACHE_DIR gave a traceback; the fix names the variable."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("STOFC_CACHE_DIR", str(cache))
    fail_writes_under(monkeypatch, cache, errno.EACCES)
    line = one_error_line(run("compile", str(example), "--mask", "causal", "--max-seq-len", L,
                              "-o", str(tmp_path / "pkg"), "--quiet"))
    assert "Permission denied" in line and "STOFC_CACHE_DIR" in line
    assert not (tmp_path / "pkg").exists()


@pytest.mark.parametrize("args", [
    ("mask", "show", "causal", "-L", "64", "-o", "{d}/m.png"),
    ("mask", "export", "causal", "-L", "64", "-o", "{d}/m.npy"),
    ("mask", "encode", "causal", "-L", "64", "-o", "{d}/m.npz"),
    ("ortlib", "-o", "{d}/lib"),
], ids=["show", "export", "encode", "ortlib"])
def test_outputs_into_a_read_only_place(example, tmp_path, monkeypatch, args):
    """Defect: mask show/export -o and ortlib -o into read-only places gave tracebacks."""
    ro = tmp_path / "ro"
    ro.mkdir()
    fail_writes_under(monkeypatch, ro, errno.EROFS)
    line = one_error_line(run(*(a.format(d=ro) for a in args)))
    assert "Read-only file system" in line and "writable location" in line
    monkeypatch.undo()
    assert list(ro.iterdir()) == []


def test_a_parent_that_cannot_exist(tmp_path):
    """A missing parent is created; one that cannot be (under a file) is one line."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = one_error_line(run("mask", "export", "causal", "-L", "64", "-o",
                              str(blocker / "sub" / "m.npy")))
    assert "Not a directory" in line
    result = run("mask", "export", "causal", "-L", "64", "-o", str(tmp_path / "a" / "b" / "m.npy"))
    assert result.exit_code == 0, result.output
    assert np.load(tmp_path / "a" / "b" / "m.npy").shape == (64, 64)


# ---------------------------------------------------------------- a real tmpfs (unshare)

DRIVER = textwrap.dedent("""
    import io, json, os, sys, contextlib
    from click.testing import CliRunner
    from stofc.cli import main
    out = {}
    for name, args in json.loads(sys.argv[1]).items():
        r = CliRunner().invoke(main, args)
        out[name] = {"code": r.exit_code, "output": r.output,
                     "left": sorted(os.listdir(os.path.dirname(args[args.index("-o") + 1])))}
    print(json.dumps(out))
""")


def _unshare_works() -> bool:
    if not shutil.which("unshare"):
        return False
    res = subprocess.run(["unshare", "-rm", "true"], capture_output=True, check=False)
    return res.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="no user/mount namespaces (unshare -rm)")
def test_real_full_and_read_only_tmpfs(example, tmp_path):
    """The same faults from a real kernel: a 256 KiB tmpfs (ENOSPC) and a read-only one."""
    full, ro = tmp_path / "full", tmp_path / "ro"
    full.mkdir()
    ro.mkdir()
    cases = {
        "compile_full": ["compile", str(example), "--mask", MASK, "--max-seq-len", L, "-o",
                         str(full / "pkg"), "--quiet"],
        "export_full": ["mask", "export", "causal", "-L", "2048", "-o", str(full / "m.npy")],
        "compile_ro": ["compile", str(example), "--mask", MASK, "--max-seq-len", L, "-o",
                       str(ro / "pkg"), "--quiet"],
        "show_ro": ["mask", "show", "causal", "-L", "64", "-o", str(ro / "m.png")],
        "ortlib_ro": ["ortlib", "-o", str(ro / "lib")],
    }
    script = (f"mount -t tmpfs -o size=256k tmpfs {full} && mount -t tmpfs tmpfs {ro} && "
              f"mount -o remount,ro {ro} && exec {sys.executable} -c \"$0\" \"$1\"")
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script, DRIVER, json.dumps(cases)],
                         capture_output=True, text=True, check=False, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for name, case in out.items():
        lines = [x for x in case["output"].splitlines() if x.strip()]
        assert case["code"] == 2, (name, case)
        assert lines[-1].startswith("error: ") and "Traceback" not in case["output"], (name, case)
        reason = "No space left on device" if name.endswith("full") else "Read-only file system"
        assert reason in lines[-1], (name, lines[-1])
        assert case["left"] == [], (name, case["left"])   # no temporary file, no half package


# ---------------------------------------------------------------- damaged cache entries


@pytest.fixture
def private_cache(example, tmp_path, monkeypatch, fresh_warnings) -> Path:
    """A cache of this test's own: the session's library and headers, no kernels."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for sub in ("ortlib", "ort-headers"):
        shutil.copytree(cache_dir() / sub, cache / sub, symlinks=True,
                        ignore=shutil.ignore_patterns(".build-*", ".fetch-*"))
    monkeypatch.setenv("STOFC_CACHE_DIR", str(cache))
    return cache


def test_truncated_cubins_and_empty_ptx_are_recompiled_not_packaged(example, private_cache,
                                                                     tmp_path, capfd):
    """Defect: truncated cached cubins and an empty cached PTX were packaged silently."""
    compile_model(example, MASK, max_seq_len=64, out_dir=tmp_path / "a",
                  instruments=Instruments(progress=False))
    entries = sorted((private_cache / "kernels").rglob("*.entry"))
    assert entries
    for entry in entries:
        data = entry.read_bytes()
        if entry.name.endswith(".ptx.entry"):   # an empty PTX with a valid header
            entry.write_bytes(cachecheck.MAGIC + f"{cachecheck.sha256_bytes(b'')} 0\n".encode())
        else:
            entry.write_bytes(data[: len(data) // 2])
    capfd.readouterr()
    pkg = compile_model(example, MASK, max_seq_len=64, out_dir=tmp_path / "b",
                        instruments=Instruments(progress=False))
    err = capfd.readouterr().err
    assert err.count("warning: ") == 1 and "/kernels/" in err, err   # once per cache
    assert "truncated" in err or "empty PTX" in err, err
    for cubin in (pkg / "kernels").glob("*.cubin"):
        assert cubin.read_bytes()[:4] == b"\x7fELF" and cubin.stat().st_size > 1000
    for ptx in (pkg / "kernels").glob("*.ptx"):
        assert b".version" in ptx.read_bytes()
    stofc.load(pkg, providers=["CPUExecutionProvider"])
    for entry in entries:   # every entry was rewritten whole
        assert cachecheck.read_entry(entry, cache="kernels") is not None


def test_truncated_cached_library_is_rebuilt_not_packaged(example, private_cache, tmp_path,
                                                          monkeypatch, capfd):
    """Defect: a truncated libstofc_ort.so in ortlib/ was copied into the package (SIGBUS)."""
    from stofc.package import ortlib

    (lib,) = (private_cache / "ortlib").glob("*/libstofc_ort.so")
    good = lib.read_bytes()
    lib.write_bytes(good[:4096])
    builds = []

    def rebuild(cxx, root, headers, work, ptx, defines=()):
        builds.append(work)
        (work / ortlib.LIBRARY_NAME).write_bytes(good)  # what g++ made the first time
        return work / ortlib.LIBRARY_NAME

    monkeypatch.setattr(ortlib, "_compile_all", rebuild)
    capfd.readouterr()
    pkg = compile_model(example, MASK, max_seq_len=64, out_dir=tmp_path / "pkg",
                        instruments=Instruments(progress=False))
    err = capfd.readouterr().err
    assert len(builds) == 1 and err.count("warning: ") == 1 and "truncated" in err, err
    assert (pkg / "libstofc_ort.so").read_bytes() == good
    assert lib.read_bytes() == good
    stofc.load(pkg, providers=["CPUExecutionProvider"])


def test_copy_of_the_library_is_checked(example, private_cache, tmp_path, monkeypatch):
    """The package's copy of the library must have the cached library's sha256."""
    from stofc.errors import StofcError
    from stofc.package import ortlib

    real = ortlib._install

    def damaging(src, dest):
        real(src, dest)
        if dest.parent != src.parent:
            dest.write_bytes(dest.read_bytes()[:100])

    monkeypatch.setattr(ortlib, "_install", damaging)
    with pytest.raises(StofcError, match="differs from the checked cached library"):
        ortlib.build_library(tmp_path / "out")


def test_edited_cached_headers_are_fetched_again(private_cache, monkeypatch, capfd):
    """Defect: cached ORT headers were not re-checked against their pinned hash on use."""
    from stofc.package import ort_headers

    monkeypatch.delenv("STOFC_ORT_INCLUDE", raising=False)
    monkeypatch.setattr(ort_headers, "SYSTEM_DIR", private_cache / "no-system-headers")
    (version_dir,) = (private_cache / "ort-headers").glob(f"{ort_headers.DEB_PACKAGE}_*")
    saved = private_cache.parent / "saved-headers"
    shutil.copytree(version_dir, saved, symlinks=True)
    header = version_dir / ort_headers.INCLUDE / "onnxruntime_c_api.h"
    header.write_text(header.read_text().replace("ORT_API_VERSION 21", "ORT_API_VERSION 99"))
    fetched = []

    def fetch(root):
        fetched.append(root)
        shutil.copytree(saved, version_dir, symlinks=True)
        return version_dir / ort_headers.INCLUDE

    monkeypatch.setattr(ort_headers, "_fetch_with_apt", fetch)
    capfd.readouterr()
    found = ort_headers.find_ort_headers()
    err = capfd.readouterr().err
    assert fetched and found.api_version == 21 and found.source == "apt"
    assert err.count("warning: ") == 1 and "onnxruntime_c_api.h differs" in err, err
    assert ort_headers.find_ort_headers().source == "cache"   # the refetched copy is trusted


def test_cache_status_and_clear_cover_every_cache(private_cache):
    """Defect: `stofc cache clear` did not clear ortlib/ or ort-headers/."""
    status = json.loads(run("cache", "status", "--json").output)
    assert status["ortlib"]["files"] >= 2 and status["ort_headers"]["files"] >= 4
    result = run("cache", "clear", "--yes")
    assert result.exit_code == 0, result.output
    for label in ("compiled kernels", "custom-op libraries", "ONNX Runtime headers"):
        assert f"cleared {label}" in result.output
    assert not (private_cache / "ortlib").exists()
    assert not (private_cache / "ort-headers").exists()


# ---------------------------------------------------------------- signals and kill -9

SLOW_CHECK = textwrap.dedent("""
    import sys, time
    import stofc.pipeline as p
    def slow(tmp, contents):
        print("IN_CHECK", tmp, flush=True)
        time.sleep(120)
    p.check_package_runs = slow
    from stofc.cli import main
    main(sys.argv[1:])
""")


def _start_slow_compile(example: Path, out: Path) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CHECK, "compile", str(example), "--mask",
                             MASK, "--max-seq-len", L, "-o", str(out), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(ROOT))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("IN_CHECK"), line + proc.stderr.read()
    return proc, Path(line.split(maxsplit=1)[1].strip())


def test_sigterm_during_compile_leaves_nothing(example, tmp_path):
    """Defect: SIGTERM during compile left .NAME.stofc.tmp-* behind."""
    out = tmp_path / "model.stofc"
    proc, tmp = _start_slow_compile(example, out)
    assert tmp.is_dir() and (tmp / "manifest.json").is_file()   # a complete, unchecked package
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1].startswith("error: stopped by SIGTERM"), err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_kill_9_during_compile_is_swept_by_the_next(example, tmp_path):
    out = tmp_path / "model.stofc"
    proc, tmp = _start_slow_compile(example, out)
    proc.kill()
    proc.wait()
    assert tmp.is_dir()          # nothing can clean up after kill -9 ...
    compile_model(example, MASK, max_seq_len=64, out_dir=out,
                  instruments=Instruments(progress=False))
    assert [p.name for p in tmp_path.iterdir()] == [out.name]   # ... but the next write does
    stofc.load(out, providers=["CPUExecutionProvider"])


FAKE_CXX = textwrap.dedent("""\
    #!/bin/sh
    # A stand-in C++ compiler: --version answers; a compile starts a child that runs long
    # (as cc1plus does under g++), unless FAKE_CXX_FAIL is set.
    if [ "$1" = "--version" ]; then echo "fakecxx 1.0 for stofc tests"; exit 0; fi
    if [ -n "$FAKE_CXX_FAIL" ]; then echo "fakecxx: error: this compiler always fails" >&2; exit 1; fi
    echo started >> "$FAKE_CXX_LOG"
    sleep 300 &
    wait
""")


def _our_processes(marker: str) -> list[str]:
    """Live processes whose command line or environment mentions ``marker``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes()
            cmd = (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if state != "Z" and (marker.encode() in env or marker.encode() in cmd):
            text = cmd.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{proc.name}: {text}")
    return found


@pytest.fixture
def fake_cxx(tmp_path) -> tuple[Path, dict]:
    cxx = tmp_path / "fakecxx"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    marker = f"stofc-fake-cxx-{os.getpid()}-{tmp_path.name}"
    env = dict(os.environ, FAKE_CXX_LOG=str(tmp_path / "cxx.log"), STOFC_TEST_MARKER=marker)
    return cxx, env


def _wait_for_compilers(log: Path, count: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= count:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("the fake compiler never started")


def _builds() -> list[Path]:
    return sorted((cache_dir() / "ortlib").glob(".build-*"))


@pytest.mark.parametrize("how", ["kill9", "sigterm"])
def test_a_stopped_library_build_leaves_no_compiler_and_no_build_dir(example, fake_cxx,
                                                                     tmp_path, how):
    """Defect: kill -9 left ortlib/.build-* and an orphaned g++ process."""
    cxx, env = fake_cxx
    marker = env["STOFC_TEST_MARKER"]
    before = _builds()
    proc = subprocess.Popen([sys.executable, "-m", "stofc", "ortlib", "-o", str(tmp_path / "lib"),
                             "--cxx", str(cxx)], env=env, cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_compilers(tmp_path / "cxx.log", 2, proc)   # two compiles run (2 jobs or more)
    assert len(_our_processes(marker)) >= 4               # reapers, compilers and their children
    assert len(_builds()) == len(before) + 1
    proc.send_signal(signal.SIGKILL if how == "kill9" else signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while _our_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _our_processes(marker) == []                   # no compiler outlives stofc
    if how == "sigterm":
        assert proc.returncode == 143 and "error: stopped by SIGTERM" in err, err
        assert _builds() == before
        return
    assert len(_builds()) == len(before) + 1              # kill -9: the directory stays ...
    failing = dict(env, FAKE_CXX_FAIL="1")
    res = subprocess.run([sys.executable, "-m", "stofc", "ortlib", "-o", str(tmp_path / "lib"),
                          "--cxx", str(cxx)], env=failing, cwd=str(ROOT), capture_output=True,
                         text=True, check=False, timeout=120)
    assert _builds() == before                            # ... until the next build sweeps it
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and lines[-1].startswith("error: fakecxx failed"), res.stderr
    assert "this compiler always fails" in lines[-1] and "--cxx" in lines[-1]
    assert "/.build-" not in lines[-1] and "(source: " + str(ROOT / "cuda" / "ort") in lines[-1]


@pytest.mark.slow
def test_a_stop_while_the_reaper_starts_its_command_still_kills_it(fake_cxx, tmp_path):
    """Defect (CI, 2026-11-27): a stop that reached a reaper between its fork and Popen's
    return found no command to kill, and a compiler outlived a kill -9ed stofc. The reaper
    now holds its stop signals until the command is recorded; STOFC_REAPER_HOLD_S widens
    that window so the stop lands inside it every time."""
    from stofc.supervise import REAPER

    cxx, env = fake_cxx
    marker = env["STOFC_TEST_MARKER"]
    env = dict(env, STOFC_REAPER_PARENT=str(os.getpid()), STOFC_REAPER_HOLD_S="2")
    reaper = subprocess.Popen([sys.executable, "-c", REAPER, str(cxx), "-c", "x.cc"], env=env)
    _wait_for_compilers(tmp_path / "cxx.log", 1, reaper)   # running, not yet recorded
    reaper.send_signal(signal.SIGTERM)
    assert reaper.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while _our_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _our_processes(marker) == []                   # the command died with it


# ---------------------------------------------------------------- concurrency


@pytest.mark.slow
def test_concurrent_compiles_into_one_directory_and_one_cache(example, private_cache, tmp_path):
    """Two compiles at once, same output, same (cold) kernel cache: both succeed, the result
    is one complete package, every cache entry is whole, nothing temporary is left."""
    out = tmp_path / "same"
    env = dict(os.environ, STOFC_CACHE_DIR=str(private_cache))
    procs = [subprocess.Popen([sys.executable, "-m", "stofc", "compile", str(example), "--mask",
                               mask, "--max-seq-len", L, "-o", str(out), "--quiet"], env=env,
                              cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for mask in (MASK, "causal")]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
        assert "warning" not in err, err
    stofc.load(out, providers=["CPUExecutionProvider"])
    assert json.loads((out / "plan.json").read_text())["mask"]["spec"] in (MASK, "causal")
    assert [p.name for p in tmp_path.iterdir() if p.name != "cache"] == ["same"]
    entries = list((private_cache / "kernels").rglob("*.entry"))
    assert entries and all(cachecheck.read_entry(e, cache="kernels") for e in entries)
    assert not [p for p in (private_cache / "kernels").rglob("*") if p.name.startswith(".")]


def test_temp_files_of_a_failed_atomic_write_are_removed(tmp_path):
    from stofc.errors import FileSystemError
    from stofc.fsutil import atomic_write

    def half(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(FileSystemError, match="No space left on device"):
        atomic_write(tmp_path / "x.bin", half)
    assert list(tmp_path.iterdir()) == []
    assert tempfile.gettempdir()  # unrelated to the target directory


def test_stopping_a_command_whose_popen_lock_a_stop_left_held_does_not_hang():
    """Defect (CI, 2026-11-28): a SIGTERM raised as an exception inside ``Popen.poll``, after
    its non-blocking acquire of the Popen's wait lock and before the ``try`` that releases
    it, left the lock held; ``_stop`` then blocked for ever in ``Popen.wait`` and ``stofc
    ortlib`` never exited. The lock is taken by hand here (CPython's private attribute),
    which is the state that race leaves."""
    import threading

    from stofc.supervise import _stop

    proc = subprocess.Popen(["sleep", "30"])
    lock = proc._waitpid_lock            # the state the race leaves: the lock held for good
    assert lock.acquire(False)
    stopper = threading.Thread(target=_stop, args=(proc,), daemon=True)
    started = time.monotonic()
    stopper.start()
    stopper.join(15)
    try:
        assert not stopper.is_alive(), "_stop blocked on the Popen's held wait lock"
        assert proc.returncode == -signal.SIGTERM   # sleep ended by the SIGTERM, reaped
        assert time.monotonic() - started < 5
    finally:
        lock.release()
        if proc.returncode is None:
            proc.kill()
            proc.wait()
