"""Builds ``libstofc_ort.so``, the ONNX Runtime custom-op library of a package.

The C++ sources are ``cuda/ort/*.cc`` (op contract: ``cuda/ort/OPS.md``). The
build uses the system C++ compiler (``$CXX`` or ``g++``), ONNX Runtime's API
headers (:func:`stofc.package.ort_headers.find_ort_headers`) and ``cuda.h`` from
the ``nvidia-cuda-runtime`` wheel (:func:`stofc.compile.include_dirs`); it links
nothing from ONNX Runtime or CUDA (the API comes from the ``OrtApiBase`` handed
to ``RegisterCustomOps``, the CUDA driver is ``dlopen``-ed), links libstdc++
statically so the library loads on any glibc machine with ORT >= 1.21, and
exports only ``RegisterCustomOps``. The CUDA twin's small key-prep kernel
(``cuda/ort/key_prep.cu``) is compiled to PTX with NVRTC and embedded (empty,
with a clear run-time error on the CUDA EP, when NVRTC is not installed).

Results are cached under ``<cache>/ortlib/<key>/`` where the key holds the hash
of every source and header (stofc's and ONNX Runtime's), the header API version,
the embedded PTX, the compiler's identity and the flags; :func:`build_library` copies the cached
library into the output directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from stofc.cachecheck import ELF_MAGIC, sha256_path, warn_once
from stofc.codegen import Source
from stofc.compile import compile_source, include_dirs
from stofc.errors import CompileError, StofcError
from stofc.fsutil import atomic_write, atomic_write_text, fs_errors, locked_tempdir
from stofc.package.ort_headers import OrtHeaders, find_ort_headers
from stofc.paths import cache_dir, cuda_dir
from stofc.supervise import Finished, Timeout, run_all
from stofc.version import __version__

LIBRARY_NAME = "libstofc_ort.so"
CXXFLAGS: tuple[str, ...] = ("-O2", "-std=c++17", "-fPIC", "-fvisibility=hidden",
                             "-fvisibility-inlines-hidden", "-Wall", "-Wextra")
LDFLAGS: tuple[str, ...] = ("-shared", "-static-libstdc++", "-static-libgcc", "-ldl")
EXPORTS_MAP = "exports.map"
_TIMEOUT_S = 600


def sources_dir() -> Path:
    """``cuda/ort``: the library's C++ sources, headers and OPS.md."""
    return cuda_dir() / "ort"


def _snapshot(dest: Path) -> Path:
    """Copies the library's sources (``cuda/ort`` without its tests) into ``dest``.

    A build hashes and compiles this one copy, so the cache key always names the
    sources that were compiled, even while ``cuda/ort`` is being edited.
    """
    shutil.copytree(sources_dir(), dest, ignore=shutil.ignore_patterns("tests", "*.md"))
    return dest


def _sources(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    root = root or sources_dir()
    units = sorted(root.glob("*.cc"))
    if not units:
        raise StofcError(f"no custom-op library sources in {root}",
                         hint="reinstall stofc or set STOFC_HOME to its source tree")
    deps = [*sorted(root.glob("*.h")), *sorted(root.glob("*.cu")), root / EXPORTS_MAP]
    return units, deps


def _compiler(compiler: str | None) -> tuple[str, str]:
    """The compiler's path and identity (``--version`` first line)."""
    name = compiler or os.environ.get("CXX") or "g++"
    path = shutil.which(name)
    if not path:
        raise StofcError(f"C++ compiler '{name}' not found",
                         hint="install g++ (apt-get install g++), or give --cxx / set CXX to a "
                              "C++17 compiler")
    try:
        res = subprocess.run([path, "--version"], capture_output=True, text=True, check=False,
                             timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as err:
        reason = getattr(err, "strerror", None) or type(err).__name__
        raise StofcError(f"C++ compiler '{name}' ({path}) cannot be run ({reason})",
                         hint=CXX_HINT) from None
    ident = res.stdout.strip().splitlines()[0] if res.stdout.strip() else name
    return path, ident


@cache
def cuda_include_dir() -> Path:
    """The directory holding ``cuda.h`` (the nvidia-cuda-runtime wheel, else CUDA_PATH)."""

    for entry in include_dirs():
        if (Path(entry) / "cuda.h").is_file():
            return Path(entry)
    raise StofcError("cuda.h not found (the CUDA twins of the stofc ops need its types)",
                     hint="install the GPU extras: pip install 'stofc[gpu]', or set CUDA_PATH")


KEY_PREP_SOURCE = "key_prep.cu"


def key_prep_ptx(root: Path | None = None) -> bytes:
    """PTX of ``cuda/ort/key_prep.cu`` (compute_80, NVRTC), or b"" when NVRTC is missing.

    Embedded in the library for the CUDA twin of SparseAttention; without it the
    CPU twins are unaffected and the CUDA twin says how to rebuild.
    """

    code = ((root or sources_dir()) / KEY_PREP_SOURCE).read_text()
    source = Source(name="stofc_key_prep", code=code, template=f"cuda/ort/{KEY_PREP_SOURCE}",
                    entry_points=("stofc_key_prep",))
    try:
        return compile_source(source, "compute_80").binary
    except CompileError:
        raise
    except StofcError:
        return b""


def _embed_ptx(ptx: bytes, path: Path) -> Path:
    """A C++ unit defining ``stofc_ort::kKeyPrepPtx`` / ``kKeyPrepPtxSize``."""
    body = ",".join(str(b) for b in ptx) if ptx else "0"
    path.write_text(
        "// Generated by stofc/package/ortlib.py: PTX of cuda/ort/key_prep.cu.\n"
        "namespace stofc_ort {\n"
        f"extern const char kKeyPrepPtx[] = {{{body}}};\n"
        f"extern const unsigned long kKeyPrepPtxSize = {len(ptx)}ul;\n"
        "}  // namespace stofc_ort\n")
    return path


def _hash_files(h: hashlib._Hash, files: list[Path], root: Path | None = None) -> None:
    for path in files:
        h.update(str(path.relative_to(root) if root else path.name).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")


def library_key(headers: OrtHeaders, compiler_ident: str, ptx: bytes = b"",
                root: Path | None = None) -> str:
    """The cache key of the library for these headers, this compiler and the embedded PTX
    (sources from ``root``, default :func:`sources_dir`; only file names and contents count)."""
    units, deps = _sources(root)
    h = hashlib.sha256(ptx)
    h.update(json.dumps({
        "stofc": __version__, "compiler": compiler_ident, "cxxflags": CXXFLAGS,
        "ldflags": LDFLAGS, "ort_api": headers.api_version,
    }, sort_keys=True).encode())
    _hash_files(h, units + deps)
    _hash_files(h, sorted(headers.include_dir.glob("*.h")))
    h.update((cuda_include_dir() / "cuda.h").read_bytes())
    return h.hexdigest()


def _compile_all(cxx: str, root: Path, headers: OrtHeaders, work: Path, ptx: bytes,
                 defines: tuple[str, ...] = ()) -> Path:
    """Compile every unit and link the library in ``work`` (each compiler run supervised by
    :mod:`stofc.supervise`, so none outlives stofc)."""
    units, _ = _sources(root)
    incs = ["-I", str(root), "-I", str(headers.include_dir), "-I", str(cuda_include_dir())]
    units = [*units, _embed_ptx(ptx, work / "key_prep_ptx.cc")]
    objects = [work / (unit.stem + ".o") for unit in units]
    commands = [(cxx, *CXXFLAGS, *(f"-D{d}" for d in defines), *incs, "-c", str(unit), "-o",
                 str(obj)) for unit, obj in zip(units, objects, strict=True)]
    jobs = max(1, min(len(units), os.cpu_count() or 1))
    for unit, res in zip(units, _run(commands, work, jobs), strict=True):
        if res.returncode != 0:
            raise _compile_failed(cxx, f"failed to compile the custom-op library ({unit.name})",
                                  res, source=_original(unit, root))
    lib = work / LIBRARY_NAME
    link = (cxx, *(str(o) for o in objects), "-o", str(lib), *LDFLAGS,
            f"-Wl,--version-script={root / EXPORTS_MAP}")
    (res,) = _run([link], work, 1)
    if res.returncode != 0:
        raise _compile_failed(cxx, f"failed to link {LIBRARY_NAME}", res)
    problem = _library_problem(lib)
    if problem:
        raise _compile_failed(cxx, f"produced a {LIBRARY_NAME} that is {problem}", res)
    return lib


def _run(commands: list[tuple[str, ...]], work: Path, jobs: int) -> list[Finished]:
    try:
        return run_all(commands, work, jobs=jobs, timeout_s=_TIMEOUT_S)
    except Timeout as err:
        raise StofcError(f"{Path(err.command[0]).name} ran longer than {err.seconds:g} s building "
                         "the custom-op library", hint=CXX_HINT) from None


CXX_HINT = ("check that --cxx / $CXX names a C++17 compiler (g++ >= 9 or clang++ >= 10) that "
            "works, e.g. `g++ --version`")


def _original(unit: Path, root: Path) -> str | None:
    """The source file in ``cuda/ort`` a snapshot unit was copied from (which outlives the
    build directory), or None for a generated unit."""
    original = sources_dir() / unit.relative_to(root) if unit.is_relative_to(root) else None
    return str(original) if original is not None and original.is_file() else None


def _compile_failed(cxx: str, what: str, res: Finished, *, source: str | None = None
                    ) -> CompileError:
    """A CompileError naming the compiler, the source (a path that exists) and the fix."""
    log = res.output.strip() or f"exit code {res.returncode}"
    return CompileError(f"{Path(cxx).name} {what}", log=log, source_path=source,
                        hint=CXX_HINT)


def _library_problem(path: Path) -> str | None:
    """Why ``path`` is not a shared library (not an ELF file, too short), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as err:
        return f"unreadable ({err.strerror})"
    if not head.startswith(ELF_MAGIC) or len(head) < 64:
        return "not an ELF shared library"
    return None


def _install(src: Path, dest: Path) -> None:
    """Copies ``src`` to ``dest`` atomically (mode 0755)."""
    atomic_write(dest, lambda f: f.write(src.read_bytes()), mode=0o755, what="write")


def build_test_library(out_dir: str | Path, defines: tuple[str, ...]) -> Path:
    """An uncached build with extra preprocessor ``defines`` (unit tests only, e.g.
    ``STOFC_CUDA_TWINS_ON_CPU``); never what a package ships."""
    headers = find_ort_headers(None)
    cxx, _ = _compiler(None)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".src-") as tmp:
        src = _snapshot(Path(tmp) / "ort")
        return _compile_all(cxx, src, headers, out_dir, key_prep_ptx(src), defines)


def build_library(out_dir: str | Path, *, ort_include: str | Path | None = None,
                  compiler: str | None = None) -> Path:
    """Builds (or takes from the cache) ``libstofc_ort.so`` and copies it into ``out_dir``.

    Returns the path of the library in ``out_dir``. The cached library is checked against
    the sha256 and size recorded in its ``key.json`` (a damaged one is rebuilt, with a
    warning), and the copy against the same hash. The build runs in a locked
    ``.build-*`` directory of the cache; ones left by a killed process are removed
    by the next build. Raises StofcError when the compiler, ORT's headers or
    ``cuda.h`` are missing, CompileError when the compiler rejects the sources.
    """
    headers = find_ort_headers(ort_include)
    cxx, ident = _compiler(compiler)
    root = cache_dir() / "ortlib"
    with fs_errors("create the custom-op library cache", root):
        root.mkdir(parents=True, exist_ok=True)
    with fs_errors("build in the custom-op library cache", root), \
            locked_tempdir(root, ".build-") as tmp:
        src = _snapshot(tmp / "ort")
        ptx = key_prep_ptx(src)
        key = library_key(headers, ident, ptx, src)
        entry = root / key[:24]
        meta = _cached_library(entry, key)
        if meta is None:
            work = tmp / "build"
            work.mkdir()
            lib = _compile_all(cxx, src, headers, work, ptx)
            _install(lib, entry / LIBRARY_NAME)
            meta = {"key": key, "compiler": ident, "ort_headers": str(headers.include_dir),
                    "ort_api": headers.api_version, "stofc": __version__,
                    "key_prep_ptx": len(ptx), "sha256": sha256_path(entry / LIBRARY_NAME),
                    "bytes": (entry / LIBRARY_NAME).stat().st_size}
            atomic_write_text(entry / KEY_FILE, json.dumps(meta, indent=2))
    dest = Path(out_dir) / LIBRARY_NAME
    with fs_errors(f"write {dest}", dest):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    _install(entry / LIBRARY_NAME, dest)
    if sha256_path(dest) != meta["sha256"]:
        dest.unlink(missing_ok=True)
        raise StofcError(f"the copy of {LIBRARY_NAME} in {out_dir} differs from the checked "
                         "cached library", hint="check the disk, then build again")
    return dest


KEY_FILE = "key.json"


def _cached_library(entry: Path, key: str) -> dict | None:
    """The ``key.json`` of a cached library whose file matches it, else None (a damaged
    entry is removed and reported once)."""
    lib, meta_path = entry / LIBRARY_NAME, entry / KEY_FILE
    if not lib.exists() and not meta_path.exists():
        return None
    problem = None
    try:
        meta = json.loads(meta_path.read_text())
        if not isinstance(meta, dict) or meta.get("key") != key or "sha256" not in meta:
            problem = "its key.json does not describe it (written by an older stofc?)"
        elif not lib.is_file() or lib.stat().st_size != meta.get("bytes"):
            problem = "the library is missing or has the wrong size (truncated)"
        elif sha256_path(lib) != meta["sha256"]:
            problem = "the library's sha256 differs from the one recorded"
        else:
            problem = _library_problem(lib)
    except (OSError, ValueError) as err:
        problem = f"its key.json cannot be read ({type(err).__name__})"
    if problem is None:
        return meta
    warn_once("ortlib", f"cached custom-op library {entry} is damaged: {problem}; rebuilding it")
    shutil.rmtree(entry, ignore_errors=True)
    return None
