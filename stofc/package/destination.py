"""Where a package goes: which directories stofc may replace, and the atomic replace.

Contract (README "Guarantees"):

* ``-o DIR`` may be a path that does not exist, an empty directory, or a
  **verified stofc package**: a directory whose ``manifest.json`` has stofc's
  format and manifest version and lists every file in it. Anything else is
  refused (:class:`~stofc.errors.PackageError`, exit 2) naming the file that
  makes DIR not a package, before any work is done: a typo in ``-o`` never
  deletes anything.
* DIR may not hold what the compile reads (the model, a mask YAML, ``--db``,
  ``--dump-dir``): ``-o`` set to the model's own folder is refused.
* :func:`write_directory` builds the package in ``.NAME.tmp-XXXXXXXX`` beside
  DIR, locked (:func:`stofc.fsutil.make_locked_tempdir`), optionally checks it
  (``verify``), then, under a short lock of the parent directory, checks DIR
  again and swaps the two with one ``renameat2(RENAME_EXCHANGE)`` (a reader
  sees the old package or the new one, never neither) and removes the old.
  Where the file system cannot exchange, DIR is first renamed to
  ``.NAME.old-XXXXXXXX``. Any failure, Ctrl-C or SIGTERM removes the temporary
  directory; after ``kill -9`` the next write to the same parent removes what
  is left (the lock of a dead process is gone, so it is known to be stale).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from stofc.errors import PackageError, StofcError
from stofc.fsutil import directory_lock, fs_errors, make_locked_tempdir, os_error, umask
from stofc.package.manifest import MANIFEST, read_manifest

ANOTHER = "choose another -o DIR (or remove that file yourself if it may go)"


def tmp_prefix(dest: Path) -> str:
    """The name prefix of a package's temporary directory."""
    return f".{dest.name}.tmp-"


def old_prefix(dest: Path) -> str:
    """The name prefix a replaced package has while it is removed (no RENAME_EXCHANGE)."""
    return f".{dest.name}.old-"


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def _foreign_entry(dest: Path, listed: set[str]) -> str | None:
    """The first path under ``dest`` that the manifest does not account for, or None."""
    dirs = {p.rsplit("/", i)[0] for p in listed for i in range(1, p.count("/") + 1)}
    for top, subdirs, files in os.walk(dest):
        rel_top = Path(top).relative_to(dest).as_posix()
        prefix = "" if rel_top == "." else f"{rel_top}/"
        for name in sorted(subdirs):
            rel = prefix + name
            if (Path(top) / name).is_symlink() or rel not in dirs:
                return rel + ("" if (Path(top) / name).is_symlink() else "/")
        subdirs.sort()
        for name in sorted(files):
            rel = prefix + name
            if rel != MANIFEST and (rel not in listed or (Path(top) / name).is_symlink()):
                return rel
    return None


def check_destination(dest: Path, *, protect: Iterable[Path | None] = ()) -> None:
    """Refuse ``dest`` unless it is absent, empty or a verified stofc package (module doc);
    ``protect``: paths the compile reads, which may not lie inside ``dest``."""
    dest = Path(dest).absolute()
    real = dest.resolve()
    for path in protect:
        if path is None:
            continue
        kept = Path(path).absolute().resolve()
        if kept == real or _inside(kept, real):
            raise PackageError(f"output directory {dest} holds {path}, which this compile "
                               "reads; replacing the directory would delete it",
                               hint="choose another -o DIR (e.g. the default <model>.stofc)")
    if dest.is_symlink():
        raise PackageError(f"output {dest} is a symbolic link",
                           hint="give the directory it points to, or another -o DIR")
    if not dest.exists():
        return
    if not dest.is_dir():
        raise PackageError(f"output {dest} exists and is not a directory",
                           hint="choose another -o DIR")
    with fs_errors("read the output directory", dest):
        empty = not any(dest.iterdir())
    if empty:
        return
    if not (dest / MANIFEST).is_file():
        raise PackageError(f"output directory {dest} is not empty and is not a stofc package "
                           f"(it has no {MANIFEST})", hint=ANOTHER)
    try:
        manifest = read_manifest(dest)
    except PackageError as err:
        raise PackageError(f"output directory {dest} is not empty and is not a stofc package "
                           f"({err.message})", hint=ANOTHER) from None
    with fs_errors("read the output directory", dest):
        foreign = _foreign_entry(dest, {rel for rel, _, _ in manifest.files})
    if foreign is not None:
        raise PackageError(f"output directory {dest} is not only a stofc package: {foreign} is "
                           f"not in its {MANIFEST}, so replacing the package would delete it",
                           hint=ANOTHER)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` atomically (Linux ``renameat2``); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def _swap(new: Path, dest: Path) -> Path | None:
    """Put ``new`` at ``dest``; returns where the replaced package now is (to be removed;
    unlocked, so a sweep may remove it too), or None."""
    if not dest.exists():
        os.rename(new, dest)
        return None
    if _exchange(new, dest):
        return new  # the old package now has the temporary name
    old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=old_prefix(dest)))
    os.rmdir(old)
    os.replace(dest, old)
    try:
        os.replace(new, dest)
    except BaseException:
        os.replace(old, dest)
        raise
    return old


def write_directory(dest: str | Path, fill: Callable[[Path], None], *,
                    verify: Callable[[Path], None] | None = None,
                    protect: Iterable[Path | None] = ()) -> Path:
    """Build a package with ``fill(tmp)``, check it with ``verify(tmp)``, and put it at
    ``dest`` atomically (module doc); returns the absolute ``dest``."""
    dest = Path(dest).absolute()
    protect = tuple(protect)
    check_destination(dest, protect=protect)
    with fs_errors("create the output's parent directory", dest.parent):
        dest.parent.mkdir(parents=True, exist_ok=True)
    with fs_errors(f"create a temporary directory beside {dest}", dest.parent):
        tmp = make_locked_tempdir(dest.parent, tmp_prefix(dest),
                                  sweep=(tmp_prefix(dest), old_prefix(dest)))
    try:
        with fs_errors("write the package", tmp.path):
            os.chmod(tmp.path, 0o777 & ~umask())
        try:
            fill(tmp.path)
        except StofcError:
            raise
        except OSError as err:
            raise os_error(err, doing="write the package") from None
        if verify is not None:
            verify(tmp.path)
        with directory_lock(dest.parent), fs_errors(f"move the package into place at {dest}"):
            check_destination(dest, protect=protect)  # nobody put anything there meanwhile
            replaced = _swap(tmp.path, dest)
    except BaseException:
        shutil.rmtree(tmp.path, ignore_errors=True)
        raise
    finally:
        tmp.release()
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)  # outside the lock: it may be large
    return dest
