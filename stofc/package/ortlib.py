"""Builds ``libstofc_ort.so``, the ONNX Runtime custom-op library of a package.

The C++ sources are ``cuda/ort/*.cc`` (op contract: ``cuda/ort/OPS.md``). The
build uses the system C++ compiler (``$CXX`` or ``g++``), ONNX Runtime's API
headers (:func:`stofc.package.ort_headers.find_ort_headers`) and ``cuda.h`` from
the ``nvidia-cuda-runtime`` wheel (:func:`stofc.compile.include_dirs`); it links
nothing from ONNX Runtime or CUDA (the API comes from the ``OrtApiBase`` handed
to ``RegisterCustomOps``, the CUDA driver is ``dlopen``-ed), links libstdc++
statically so the library loads on any glibc machine with ORT >= 1.21, and
exports only ``RegisterCustomOps``.

Results are cached under ``<cache>/ortlib/<key>/`` where the key holds the hash
of every source and header (stofc's and ONNX Runtime's), the header API version,
the compiler's identity and the flags; :func:`build_library` copies the cached
library into the output directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from stofc import __version__
from stofc.errors import CompileError, StofcError
from stofc.package.ort_headers import OrtHeaders, find_ort_headers
from stofc.paths import cache_dir, cuda_dir

LIBRARY_NAME = "libstofc_ort.so"
CXXFLAGS: tuple[str, ...] = ("-O2", "-std=c++17", "-fPIC", "-fvisibility=hidden",
                             "-fvisibility-inlines-hidden", "-Wall", "-Wextra")
LDFLAGS: tuple[str, ...] = ("-shared", "-static-libstdc++", "-static-libgcc", "-ldl")
EXPORTS_MAP = "exports.map"
_TIMEOUT_S = 600


def sources_dir() -> Path:
    """``cuda/ort``: the library's C++ sources, headers and OPS.md."""
    return cuda_dir() / "ort"


def _sources() -> tuple[list[Path], list[Path]]:
    root = sources_dir()
    units = sorted(root.glob("*.cc"))
    if not units:
        raise StofcError(f"no custom-op library sources in {root}",
                         hint="reinstall stofc or set STOFC_HOME to its source tree")
    deps = [*sorted(root.glob("*.h")), root / EXPORTS_MAP]
    return units, deps


def _compiler(compiler: str | None) -> tuple[str, str]:
    """The compiler's path and identity (``--version`` first line)."""
    name = compiler or os.environ.get("CXX") or "g++"
    path = shutil.which(name)
    if not path:
        raise StofcError(f"C++ compiler '{name}' not found",
                         hint="install g++ (apt-get install g++) or set CXX to a C++17 compiler")
    res = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    ident = res.stdout.strip().splitlines()[0] if res.stdout.strip() else name
    return path, ident


@cache
def cuda_include_dir() -> Path:
    """The directory holding ``cuda.h`` (the nvidia-cuda-runtime wheel, else CUDA_PATH)."""
    from stofc.compile import include_dirs

    for entry in include_dirs():
        if (Path(entry) / "cuda.h").is_file():
            return Path(entry)
    raise StofcError("cuda.h not found (the CUDA twins of the stofc ops need its types)",
                     hint="install the GPU extras: pip install 'stofc[gpu]', or set CUDA_PATH")


def _hash_files(h: hashlib._Hash, files: list[Path], root: Path | None = None) -> None:
    for path in files:
        h.update(str(path.relative_to(root) if root else path.name).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")


def library_key(headers: OrtHeaders, compiler_ident: str) -> str:
    """The cache key of the library for these headers and this compiler."""
    units, deps = _sources()
    h = hashlib.sha256()
    h.update(json.dumps({
        "stofc": __version__, "compiler": compiler_ident, "cxxflags": CXXFLAGS,
        "ldflags": LDFLAGS, "ort_api": headers.api_version,
    }, sort_keys=True).encode())
    _hash_files(h, units + deps)
    _hash_files(h, sorted(headers.include_dir.glob("*.h")))
    h.update((cuda_include_dir() / "cuda.h").read_bytes())
    return h.hexdigest()


def _compile_all(cxx: str, units: list[Path], headers: OrtHeaders, work: Path) -> Path:
    incs = ["-I", str(sources_dir()), "-I", str(headers.include_dir), "-I", str(cuda_include_dir())]

    def one(unit: Path) -> Path:
        obj = work / (unit.stem + ".o")
        cmd = [cxx, *CXXFLAGS, *incs, "-c", str(unit), "-o", str(obj)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
        if res.returncode != 0:
            raise CompileError(f"{Path(cxx).name} failed to compile the custom-op library",
                               log=res.stderr, source_path=str(unit))
        return obj

    jobs = max(1, min(len(units), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        objects = list(pool.map(one, units))
    lib = work / LIBRARY_NAME
    cmd = [cxx, *(str(o) for o in objects), "-o", str(lib), *LDFLAGS,
           f"-Wl,--version-script={sources_dir() / EXPORTS_MAP}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    if res.returncode != 0:
        raise CompileError(f"{Path(cxx).name} failed to link {LIBRARY_NAME}", log=res.stderr)
    return lib


def _install(src: Path, dest: Path) -> None:
    """Copies ``src`` to ``dest`` atomically."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_library(out_dir: str | Path, *, ort_include: str | Path | None = None,
                  compiler: str | None = None) -> Path:
    """Builds (or takes from the cache) ``libstofc_ort.so`` and copies it into ``out_dir``.

    Returns the path of the library in ``out_dir``. Raises StofcError when the
    compiler, ORT's headers or ``cuda.h`` are missing, CompileError when the
    compiler rejects the sources.
    """
    headers = find_ort_headers(ort_include)
    cxx, ident = _compiler(compiler)
    key = library_key(headers, ident)
    cached = cache_dir() / "ortlib" / key[:24] / LIBRARY_NAME
    if not cached.is_file():
        units, _ = _sources()
        cached.parent.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cached.parent.parent, prefix=".build-") as tmp:
            lib = _compile_all(cxx, units, headers, Path(tmp))
            _install(lib, cached)
            (cached.parent / "key.json").write_text(json.dumps({
                "key": key, "compiler": ident, "ort_headers": str(headers.include_dir),
                "ort_api": headers.api_version, "stofc": __version__,
            }, indent=2))
    dest = Path(out_dir) / LIBRARY_NAME
    _install(cached, dest)
    return dest
