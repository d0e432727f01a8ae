"""Content-checked cache entries: every read of stofc's caches verifies what was written.

Each cache stores, with every entry, the sha256 of its content, and checks it
on every read (README "Guarantees"):

=====================  ==================================  ===========================
cache                  entry                               recorded hash
=====================  ==================================  ===========================
``kernels/``           a cubin or PTX (:func:`write_entry`) a header line of the entry
``ortlib/<key>/``      ``libstofc_ort.so``                 ``key.json`` (``sha256``,
                                                           ``bytes``)
``ort-headers/<v>/``   the ONNX Runtime headers            ``stofc-headers.json``, and
                                                           the pinned hashes of the
                                                           pinned version
``tuning.sqlite``      a tuning record or sample           its ``digest`` column
=====================  ==================================  ===========================

On a mismatch (a truncated or edited file, a partial write from an old
version) the entry is removed, rebuilt by the caller, and a warning is printed
once per cache and process (:func:`warn_once`). Binaries are also checked for
their kind (:func:`check_binary`: a cubin is an ELF file, PTX text names its
``.version`` and ``.target``), before they are cached and again before they
are written into a package.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from stofc.errors import StofcError
from stofc.fsutil import atomic_write_bytes

MAGIC = b"stofc-cache-entry 1 "
ELF_MAGIC = b"\x7fELF"
_warned: set[str] = set()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_path(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def warn_once(cache: str, message: str) -> None:
    """Print ``warning: MESSAGE`` to stderr the first time ``cache`` reports a problem in
    this process (later problems in the same cache are repaired silently)."""
    if cache in _warned:
        return
    _warned.add(cache)
    print(f"warning: {message} (further damaged entries of this cache are rebuilt without "
          "a warning)", file=sys.stderr)


def write_entry(path: Path, payload: bytes) -> Path:
    """Store ``payload`` at ``path`` atomically, headed by its sha256 and length."""
    head = MAGIC + f"{sha256_bytes(payload)} {len(payload)}\n".encode()
    return atomic_write_bytes(path, head + payload)


def read_entry(path: Path, *, cache: str) -> bytes | None:
    """The payload stored at ``path``; None when absent, or when damaged (then the file is
    removed and :func:`warn_once` says so)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        warn_once(cache, f"cannot read cache entry {path} ({err.strerror}); rebuilding it")
        return None
    problem = _entry_problem(data)
    if problem is None:
        return data[data.index(b"\n") + 1:]
    warn_once(cache, f"cache entry {path} is damaged ({problem}); removed it and rebuilt it")
    path.unlink(missing_ok=True)
    return None


def _entry_problem(data: bytes) -> str | None:
    if not data.startswith(MAGIC) or b"\n" not in data[:len(MAGIC) + 100]:
        return "no stofc entry header"
    head, _, payload = data.partition(b"\n")
    fields = head[len(MAGIC):].split()
    if len(fields) != 2 or not fields[1].isdigit():
        return "malformed entry header"
    digest, size = fields[0].decode(errors="replace"), int(fields[1])
    if len(payload) != size:
        return f"{len(payload)} bytes instead of {size}: truncated"
    if sha256_bytes(payload) != digest:
        return "sha256 differs from the one recorded"
    return None


def binary_problem(binary: bytes, target: str) -> str | None:
    """Why ``binary`` is not a plausible cubin (``sm_*``) / PTX (``compute_*``), or None."""
    if target.startswith("compute_"):
        if not binary.strip():
            return "empty PTX"
        if b".version" not in binary[:4096] or b".target" not in binary[:4096]:
            return "PTX without .version/.target"
        return None
    if not binary.startswith(ELF_MAGIC):
        return "a cubin that is not an ELF file"
    if len(binary) < 64:
        return f"a {len(binary)}-byte cubin (truncated)"
    return None


def check_binary(binary: bytes, target: str, name: str, *, sha256: str | None = None) -> None:
    """Raise (a stofc bug, exit 2) when a binary about to be packaged is not what it should
    be: the wrong kind, or not the content that was compiled (``sha256``)."""
    problem = binary_problem(binary, target)
    if problem is None and sha256 and sha256_bytes(binary) != sha256:
        problem = "content differs from what was compiled"
    if problem:
        raise StofcError(f"the compiled kernel {name} for {target} is {problem}",
                         hint="run `stofc cache clear --kernels --yes` and compile again; if it "
                              "persists, report it")
