"""``manifest.json``: the sha256 of every file of a package, and what it was built for.

Schema (``MANIFEST_VERSION``)::

    {"format": "stofc-package", "manifest_version": 1, "stofc": "0.1.0",
     "gpu": "h100", "arch": "sm_90", "ptx": "compute_90", "dtype": "float16",
     "files": {"model.onnx": {"sha256": "...", "bytes": 123}, ...}}

Every file of the package except the manifest itself is listed (paths relative
to the package, ``/``-separated). :func:`check_manifest` is what loading runs:
a missing or extra-edited file is a one-line :class:`~stofc.errors.PackageError`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from stofc.errors import PackageError

MANIFEST = "manifest.json"
ARCH_RE = re.compile(r"sm_[1-9][0-9]{1,2}a?")
PTX_RE = re.compile(r"compute_[1-9][0-9]{1,2}a?")
MANIFEST_VERSION = 1
FORMAT = "stofc-package"


@dataclass(frozen=True)
class Manifest:
    """The parsed manifest."""

    stofc: str
    gpu: str
    arch: str
    ptx: str
    dtype: str
    files: tuple[tuple[str, str, int], ...]   # (path, sha256, bytes)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "manifest_version": MANIFEST_VERSION, "stofc": self.stofc,
                "gpu": self.gpu, "arch": self.arch, "ptx": self.ptx, "dtype": self.dtype,
                "files": {p: {"sha256": h, "bytes": n} for p, h, n in self.files}}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(root: Path, *, stofc: str, gpu: str, arch: str, ptx: str,
                   dtype: str) -> Manifest:
    """Hash every file under ``root`` (except the manifest)."""
    files = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST:
            continue
        files.append((rel, sha256_file(path), path.stat().st_size))
    return Manifest(stofc, gpu, arch, ptx, dtype, tuple(files))


def write_manifest(root: Path, manifest: Manifest) -> Path:
    path = root / MANIFEST
    path.write_text(json.dumps(manifest.to_dict(), indent=1, sort_keys=True) + "\n")
    return path


def read_manifest(root: Path) -> Manifest:
    """The manifest of the package in ``root``; PackageError when absent or malformed."""
    path = root / MANIFEST
    if not path.is_file():
        raise PackageError(f"{root} has no {MANIFEST}, so it is not a complete stofc package",
                           hint="write it again with `stofc compile`")
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}")
        if data.get("manifest_version") != MANIFEST_VERSION:
            raise ValueError(f"manifest_version {data.get('manifest_version')!r} is not "
                             f"{MANIFEST_VERSION}")
        files = tuple((str(p), str(e["sha256"]), int(e["bytes"]))
                      for p, e in sorted(data["files"].items()))
        for rel, _, _ in files:
            parts = rel.split("/")
            if rel.startswith("/") or ".." in parts or "" in parts or rel == MANIFEST:
                raise ValueError(f"file entry {rel!r} is not a path inside the package")
        arch, ptx = str(data["arch"]), str(data["ptx"])
        if not ARCH_RE.fullmatch(arch):
            raise ValueError(f"arch {arch!r} is not a GPU architecture (sm_XY)")
        if not PTX_RE.fullmatch(ptx):
            raise ValueError(f"ptx {ptx!r} is not a PTX target (compute_XY)")
        return Manifest(str(data["stofc"]), str(data["gpu"]), arch, ptx, str(data["dtype"]),
                        files)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise PackageError(f"{path} is malformed ({type(err).__name__}: {err})",
                           hint="write the package again with `stofc compile`") from None


def check_manifest(root: Path) -> Manifest:
    """Every listed file exists with its hash; raises one PackageError line otherwise."""
    manifest = read_manifest(root)
    for rel, digest, size in manifest.files:
        path = root / rel
        if not path.is_file():
            raise PackageError(f"package {root} is missing {rel}",
                               hint="copy the whole package directory or run `stofc compile` again")
        if path.stat().st_size != size or sha256_file(path) != digest:
            raise PackageError(f"{rel} in package {root} was modified after `stofc compile` "
                               "(sha256 differs from manifest.json)",
                               hint="restore the file or run `stofc compile` again")
    return manifest
