"""NVRTC through CuPy: rendered CUDA source to cubin (or PTX), no GPU needed.

NVRTC has no default include path; :func:`include_dirs` gives it ``cuda/``
(stofc's own headers) and the CUDA headers of the ``nvidia-cuda-runtime``
wheel (or ``$CUDA_PATH/include``). Results are cached on disk under a key that
holds everything that can change the binary: the source hash, the hashes of
stofc's headers, the options, the target, the NVRTC version and stofc's
version. A failed compile dumps the source and raises :class:`CompileError`
with NVRTC's log and the dump's path.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from stofc.cachecheck import binary_problem, read_entry, sha256_bytes, warn_once, write_entry
from stofc.codegen import Source
from stofc.errors import CompileError, StofcError
from stofc.paths import cache_dir, cuda_dir
from stofc.version import __version__

DEFAULT_OPTIONS: tuple[str, ...] = ("--std=c++17", "-default-device")


@dataclass(frozen=True)
class CompiledKernel:
    """A compiled translation unit for one target.

    ``target`` is ``sm_XY`` (``binary`` is a cubin) or ``compute_XY`` (``binary``
    is PTX text as bytes). ``key`` is the cache key it was stored under.
    """

    name: str
    target: str
    binary: bytes
    entry_points: tuple[str, ...]
    nvrtc_version: str
    options: tuple[str, ...]
    key: str
    sha256: str = ""   # of ``binary``; the package writer checks it before writing the file

    @property
    def is_ptx(self) -> bool:
        return self.target.startswith("compute_")


_NVRTC_LOAD = threading.Lock()
_nvrtc_loaded: Any = None


def _nvrtc() -> Any:
    """CuPy's NVRTC module, its library loaded once per process under a lock.

    The first call into the module loads libnvrtc (cuda-pathfinder), which then preloads
    libnvrtc-builtins by path: the library has no RUNPATH, so NVRTC cannot find its builtins
    by itself. Two compile-stage threads making the first call at once let one compile
    between the other's library load and its builtins preload, and NVRTC failed with
    "failed to open libnvrtc-builtins.so.13.0" (LD_DEBUG showed the order). Loading here,
    one thread at a time, closes that window."""
    global _nvrtc_loaded
    if _nvrtc_loaded is None:
        with _NVRTC_LOAD:
            if _nvrtc_loaded is None:
                try:
                    from cupy_backends.cuda.libs import nvrtc  # optional: the GPU extras
                except ImportError as err:  # pragma: no cover - depends on the install
                    raise StofcError(
                        f"NVRTC is not available ({err})",
                        hint="install the GPU extras: pip install 'stofc[gpu]'",
                    ) from err
                nvrtc.getVersion()          # loads the library (and its builtins) now
                _nvrtc_loaded = nvrtc
    return _nvrtc_loaded


@cache
def nvrtc_version() -> str:
    """The NVRTC version as ``major.minor`` (e.g. ``13.0``)."""
    major, minor = _nvrtc().getVersion()
    return f"{major}.{minor}"


@cache
def include_dirs() -> tuple[str, ...]:
    """Include directories for NVRTC: stofc's ``cuda/``, then the CUDA headers."""
    dirs = [str(cuda_dir())]
    for entry in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include"):
            candidate = Path(entry) / sub
            if (candidate / "cuda_fp16.h").is_file():
                dirs.append(str(candidate))
    for env in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(env)
        if root and (Path(root) / "include" / "cuda_fp16.h").is_file():
            dirs.append(str(Path(root) / "include"))
    if (Path("/usr/local/cuda/include") / "cuda_fp16.h").is_file():
        dirs.append("/usr/local/cuda/include")
    if len(dirs) == 1:
        raise StofcError(
            "CUDA headers (cuda_fp16.h) not found",
            hint="install the GPU extras (pip install 'stofc[gpu]') or set CUDA_PATH",
        )
    return tuple(dict.fromkeys(dirs))


@cache
def _headers_digest() -> str:
    """Hash of every stofc header a source may include (part of the cache key)."""
    digest = hashlib.sha256()
    root = cuda_dir()
    for path in sorted(root.rglob("*.cuh")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key(source: Source, target: str, options: tuple[str, ...]) -> str:
    """The content address of a compile: everything that can make a binary stale."""
    fields = {
        "source": source.sha256,
        "headers": _headers_digest(),
        "target": target,
        "options": list(options),
        "nvrtc": nvrtc_version(),
        "stofc": __version__,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def dump_source(source: Source) -> Path:
    """Write the source to ``$STOFC_DUMP_DIR`` (or a temporary directory); return the path."""
    root = Path(os.environ.get("STOFC_DUMP_DIR") or Path(tempfile.gettempdir()) / "stofc-dump")
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{source.name}-{source.sha256[:12]}.cu"
    path.write_text(source.code)
    return path


def _check_target(target: str) -> None:
    kind, _, number = target.partition("_")
    if kind not in ("sm", "compute") or not number.rstrip("a").isdigit():
        raise StofcError(f"unknown compile target {target!r}",
                         hint="use sm_XY for a cubin or compute_XY for PTX, e.g. sm_90")


def compile_source(source: Source, target: str, *, options: tuple[str, ...] = (),
                   use_cache: bool = True) -> CompiledKernel:
    """Compile ``source`` for ``target`` (``sm_90``, ``sm_90a``, ``compute_80``...).

    Returns the cubin (``sm_*``) or PTX (``compute_*``). Cached on disk by
    :func:`cache_key` unless ``use_cache`` is false. Raises
    :class:`CompileError` with the NVRTC log and the dumped source path.
    """
    _check_target(target)
    opts = (*DEFAULT_OPTIONS, *options, f"-arch={target}",
            *(f"-I{d}" for d in include_dirs()))
    key = cache_key(source, target, (*DEFAULT_OPTIONS, *options))
    cached = kernel_cache_path(key, target)
    binary = read_entry(cached, cache="kernels") if use_cache else None
    if binary is not None and binary_problem(binary, target):
        warn_once("kernels", f"cache entry {cached} holds {binary_problem(binary, target)}; "
                             "removed it and compiled again")
        cached.unlink(missing_ok=True)
        binary = None
    if binary is None:
        binary = _run_nvrtc(source, opts, ptx=target.startswith("compute_"))
        problem = binary_problem(binary, target)
        if problem:
            raise CompileError(f"NVRTC returned {problem} for {source.name} ({target})",
                               hint="report it with the NVRTC version")
        if use_cache:
            write_entry(cached, binary)
    return CompiledKernel(name=source.name, target=target, binary=binary,
                          entry_points=source.entry_points, nvrtc_version=nvrtc_version(),
                          options=(*DEFAULT_OPTIONS, *options), key=key,
                          sha256=sha256_bytes(binary))


def kernel_cache_path(key: str, target: str) -> Path:
    """Where the kernel of cache key ``key`` is stored (a :func:`~stofc.cachecheck.write_entry`
    file: the binary headed by its sha256)."""
    kind = "ptx" if target.startswith("compute_") else "cubin"
    return cache_dir() / "kernels" / key[:2] / f"{key}.{kind}.entry"


def _run_nvrtc(source: Source, opts: tuple[str, ...], *, ptx: bool) -> bytes:
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source.code, f"{source.name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(opts))
        except Exception as err:
            log = nvrtc.getProgramLog(prog)
            try:
                path: str | None = str(dump_source(source))
            except OSError:  # the dump is a courtesy; NVRTC's log is the error
                path = None
            raise CompileError(f"NVRTC failed to compile {source.name} ({source.template})",
                               log=log or str(err), source_path=path) from None
        if ptx:
            text = nvrtc.getPTX(prog)
            return text.encode() if isinstance(text, str) else bytes(text)
        return bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)
