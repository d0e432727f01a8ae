"""ONNX Runtime's C/C++ API headers for building the custom-op library.

The library is built against the headers of ORT 1.21 (``ORT_API_VERSION`` 21),
which keeps it loadable by ORT 1.21 and every newer runtime. Where they come
from, first match wins:

1. an explicit directory (``--ort-include DIR``, the ``include`` argument) or
   ``$STOFC_ORT_INCLUDE``;
2. the system copy of Debian's ``libonnxruntime-dev`` (``/usr/include/onnxruntime``);
3. a copy unpacked earlier into ``<cache>/ort-headers/``;
4. apt, through the machine's own apt configuration (no host names here):
   - where a configured suite carries ``libonnxruntime-dev`` (Debian trixie and
     later), ``apt-get download libonnxruntime-dev``: apt checks it against its
     signed indices;
   - otherwise (Debian bookworm, whose suites lack the package) the pinned
     1.21.0+dfsg-1 ``.deb`` is fetched by apt's own downloader
     (``apt-helper download-file``) from the pool of the Debian archive the
     machine's sources already use (``apt-get indextargets``), and checked
     against the SHA-256 pinned below;
   then ``dpkg-deb -x`` unpacks it into the cache. The headers are
   architecture-independent, so the amd64 ``.deb`` serves every machine.

The onnxruntime pip wheels ship no C/C++ headers, so they are no fallback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from stofc.cachecheck import sha256_path, warn_once
from stofc.errors import StofcError
from stofc.fsutil import atomic_write_text, fs_errors, make_locked_tempdir
from stofc.paths import cache_dir

DEB_PACKAGE = "libonnxruntime-dev"
PINNED_VERSION = "1.21.0+dfsg-1"
PINNED_DEB = f"{DEB_PACKAGE}_{PINNED_VERSION}_amd64.deb"
PINNED_POOL = "pool/main/o/onnxruntime"
# sha256 of PINNED_DEB as served by the Debian archive (85 340 bytes).
PINNED_SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
# sha256 of the required headers in PINNED_VERSION: a cached copy is checked against them.
PINNED_HEADERS = {
    "onnxruntime_c_api.h": "7783e9664bdb0b1b36145b5c8587dd1bc9a399aa000edf2e3dd03003cafc6882",
    "onnxruntime_cxx_api.h": "b3b27d6a6fced0725e3f188379cca008b1d7a456997684756374d4b388f2cf05",
    "onnxruntime_cxx_inline.h": "7f448e994c732eacd9e49900365fefa8f1ac998a6d6eb78e5f4aab1b8d9d8900",
    "onnxruntime_float16.h": "6c4db3d1954b266c4febe413351af86cac922e3448538e7e452e51d646e56a4a",
}
HEADERS_MANIFEST = "stofc-headers.json"
INCLUDE = "usr/include/onnxruntime"
MIN_API_VERSION = 21
REQUIRED = ("onnxruntime_c_api.h", "onnxruntime_cxx_api.h", "onnxruntime_cxx_inline.h",
            "onnxruntime_float16.h")
SYSTEM_DIR = Path("/usr/include/onnxruntime")
APT_HELPER = Path("/usr/lib/apt/apt-helper")
_TIMEOUT_S = 180


@dataclass(frozen=True)
class OrtHeaders:
    """A directory holding ``onnxruntime_cxx_api.h`` and friends."""

    include_dir: Path
    api_version: int    # ORT_API_VERSION of onnxruntime_c_api.h
    source: str         # "explicit", "environment", "system", "cache", "apt"


def header_api_version(include_dir: Path) -> int:
    """``ORT_API_VERSION`` as defined in ``include_dir/onnxruntime_c_api.h``."""
    text = (include_dir / "onnxruntime_c_api.h").read_text(errors="replace")
    match = re.search(r"^#define\s+ORT_API_VERSION\s+(\d+)", text, re.MULTILINE)
    if not match:
        raise StofcError(f"{include_dir}/onnxruntime_c_api.h defines no ORT_API_VERSION",
                         hint="point --ort-include at ONNX Runtime's include directory")
    return int(match.group(1))


def _locate(root: Path) -> Path | None:
    """The directory under ``root`` (a few usual layouts) holding every required header."""
    for cand in (root, root / "onnxruntime", root / "onnxruntime/core/session", root / "core/session"):
        if all((cand / name).is_file() for name in REQUIRED):
            return cand
    return None


def _checked(root: Path, source: str) -> OrtHeaders:
    found = _locate(root)
    if found is None:
        raise StofcError(f"no ONNX Runtime headers ({', '.join(REQUIRED)}) under {root}",
                         hint="pass the directory holding onnxruntime_cxx_api.h")
    api = header_api_version(found)
    if api < MIN_API_VERSION:
        raise StofcError(f"the ONNX Runtime headers in {found} are API {api}; stofc needs API "
                         f">= {MIN_API_VERSION} (ORT 1.21)",
                         hint="use the headers of ORT 1.21 (Debian libonnxruntime-dev 1.21)")
    return OrtHeaders(found, api, source)


def headers_cache_dir() -> Path:
    """Where fetched header packages are unpacked."""
    return cache_dir() / "ort-headers"


def find_ort_headers(include: str | Path | None = None, *, fetch: bool = True) -> OrtHeaders:
    """The ORT headers to build against, fetched through apt when nothing local has them.

    Raises StofcError with the way out when none can be found or fetched.
    """
    if include:
        return _checked(Path(include), "explicit")
    env = os.environ.get("STOFC_ORT_INCLUDE")
    if env:
        return _checked(Path(env), "environment")
    if _locate(SYSTEM_DIR):
        return _checked(SYSTEM_DIR, "system")
    root = headers_cache_dir()
    for version_dir in sorted(root.glob(f"{DEB_PACKAGE}_*"), reverse=True):
        if version_dir.name.startswith(".") or not version_dir.is_dir():
            continue
        problem = cached_headers_problem(version_dir)
        if problem:
            warn_once("ort-headers", f"cached ONNX Runtime headers {version_dir} are damaged "
                                     f"({problem}); removed them and fetching again")
            shutil.rmtree(version_dir, ignore_errors=True)
            continue
        if _locate(version_dir / INCLUDE):
            return _checked(version_dir / INCLUDE, "cache")
    if not fetch:
        raise StofcError("no ONNX Runtime headers found",
                         hint="install libonnxruntime-dev or pass --ort-include DIR")
    return _checked(_fetch_with_apt(root), "apt")


def _header_hashes(version_dir: Path) -> dict[str, str]:
    include = version_dir / INCLUDE
    return {p.relative_to(include).as_posix(): sha256_path(p)
            for p in sorted(include.rglob("*")) if p.is_file()}


def _pinned_problem(version_dir: Path, hashes: dict[str, str]) -> str | None:
    if version_dir.name != f"{DEB_PACKAGE}_{PINNED_VERSION.replace(':', '_')}":
        return None
    for name, digest in PINNED_HEADERS.items():
        if hashes.get(name) != digest:
            return f"{name} differs from the pinned {PINNED_VERSION} header"
    return None


def record_headers(version_dir: Path) -> None:
    """Write ``stofc-headers.json``: the sha256 of every header under ``version_dir``."""
    atomic_write_text(version_dir / HEADERS_MANIFEST,
                      json.dumps(_header_hashes(version_dir), indent=1, sort_keys=True))


def cached_headers_problem(version_dir: Path) -> str | None:
    """Why the headers cached in ``version_dir`` cannot be trusted, or None: each file must
    match the sha256 recorded when it was unpacked, and the pinned version's required
    headers their pinned hashes. A copy from before the record existed is accepted (and
    recorded) only when it is the pinned version and matches the pinned hashes."""
    try:
        hashes = _header_hashes(version_dir)
        pinned = _pinned_problem(version_dir, hashes)
        manifest = version_dir / HEADERS_MANIFEST
        if not manifest.is_file():
            if pinned is None and version_dir.name.endswith(PINNED_VERSION.replace(":", "_")):
                record_headers(version_dir)
                return None
            return pinned or f"no {HEADERS_MANIFEST} (unpacked by an older stofc)"
        recorded = json.loads(manifest.read_text())
        if not isinstance(recorded, dict) or not recorded:
            return f"{HEADERS_MANIFEST} is malformed"
        for name, digest in recorded.items():
            if name not in hashes:
                return f"{name} is missing"
            if hashes[name] != digest:
                return f"{name} differs from its recorded sha256"
        return pinned
    except (OSError, ValueError) as err:
        return f"cannot be read ({type(err).__name__})"


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=_TIMEOUT_S,
                          check=False)


def _apt_candidate() -> str | None:
    """The version apt would install from the configured suites, or None."""
    if not shutil.which("apt-cache"):
        return None
    out = _run(["apt-cache", "policy", DEB_PACKAGE]).stdout
    match = re.search(r"Candidate:\s*(\S+)", out)
    return match.group(1) if match and match.group(1) != "(none)" else None


def debian_archive_uris() -> list[str]:
    """Base URIs of the Debian archives in this machine's apt sources (main archive first)."""
    if not shutil.which("apt-get"):
        return []
    out = _run(["apt-get", "indextargets", "--format", "$(REPO_URI)", "Origin: Debian",
                "Label: Debian", "Identifier: Packages"]).stdout
    uris: list[str] = []
    for line in out.splitlines():
        uri = line.strip()
        if uri and uri not in uris:
            uris.append(uri if uri.endswith("/") else uri + "/")
    return uris


def _apt_error(res: subprocess.CompletedProcess) -> str:
    """apt's first error line (e.g. "E: Failed to fetch URI  Hash Sum mismatch")."""
    lines = [ln.strip() for ln in (res.stderr + "\n" + res.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("E:")]
    return " ".join((errors or lines[-1:] or [f"exit code {res.returncode}"])[0].split())


def _download(workdir: Path) -> Path:
    """Fetches the .deb into ``workdir`` through apt; returns its path."""
    errors: list[str] = []
    if _apt_candidate():
        res = _run(["apt-get", "download", DEB_PACKAGE], cwd=workdir)
        debs = sorted(workdir.glob(f"{DEB_PACKAGE}_*.deb"))
        if res.returncode == 0 and debs:
            return debs[0]
        errors.append(f"apt-get download: {_apt_error(res)}")
    if not APT_HELPER.is_file():
        errors.append(f"{APT_HELPER} is missing")
    for base in debian_archive_uris() if APT_HELPER.is_file() else []:
        dest = workdir / PINNED_DEB
        res = _run([str(APT_HELPER), "download-file", f"{base}{PINNED_POOL}/{PINNED_DEB}",
                    str(dest), f"SHA256:{PINNED_SHA256}"], cwd=workdir)
        if res.returncode == 0 and dest.is_file():
            return dest
        dest.unlink(missing_ok=True)
        errors.append(f"{base}: {_apt_error(res)}")
    if not errors:
        errors.append("no Debian archive in apt's package lists: run 'apt-get update' first")
    raise StofcError(f"cannot fetch {DEB_PACKAGE} through apt ({'; '.join(errors)})",
                     hint="install libonnxruntime-dev (1.21 or later), or pass --ort-include DIR "
                          "/ set STOFC_ORT_INCLUDE to a directory holding onnxruntime_cxx_api.h")


def _fetch_with_apt(root: Path) -> Path:
    """Downloads and unpacks libonnxruntime-dev into ``root/<version>``; returns that dir."""
    if not shutil.which("dpkg-deb"):
        raise StofcError("dpkg-deb is missing, so the ONNX Runtime headers cannot be unpacked",
                         hint="pass --ort-include DIR or set STOFC_ORT_INCLUDE")
    with fs_errors("create the ONNX Runtime header cache", root):
        root.mkdir(parents=True, exist_ok=True)
        locked = make_locked_tempdir(root, ".fetch-")  # a killed fetch's is swept next time
    work = locked.path
    try:
        os.chmod(work, 0o755)  # apt's sandbox user may write here
        deb = _download(work)
        version = _run(["dpkg-deb", "-f", str(deb), "Version"]).stdout.strip() or "unknown"
        unpacked = work / "root"
        res = _run(["dpkg-deb", "-x", str(deb), str(unpacked)])
        if res.returncode != 0 or _locate(unpacked / INCLUDE) is None:
            raise StofcError(f"unpacking {deb.name} gave no ONNX Runtime headers ({res.stderr.strip()})",
                             hint="pass --ort-include DIR or set STOFC_ORT_INCLUDE")
        final = root / f"{DEB_PACKAGE}_{version.replace(':', '_')}"
        problem = _pinned_problem(final, _header_hashes(unpacked))
        if problem:
            raise StofcError(f"the fetched {deb.name} is not the pinned package ({problem})",
                             hint="pass --ort-include DIR or set STOFC_ORT_INCLUDE")
        record_headers(unpacked)
        if not final.exists():
            try:
                os.replace(unpacked, final)
            except OSError:
                if not final.exists():  # a concurrent fetch won the race otherwise
                    raise
        return final / INCLUDE
    finally:
        shutil.rmtree(work, ignore_errors=True)
        locked.release()
