"""File-system helpers for every writer: one clear error per fault, atomic files, and
temporary directories that a killed process cannot leave in anyone's way.

Errors. :func:`os_error` turns an :class:`OSError` into a one-line
:class:`~stofc.errors.FileSystemError` (exit 2): what could not be done, on
which path, the operating system's reason, and a fix chosen by ``errno``
(read-only file system, permission, disk full, missing or wrong-kind path).
A path inside stofc's cache directory gets the fix "set STOFC_CACHE_DIR".
:func:`fs_errors` applies it to a block.

Atomic files. :func:`atomic_write` writes a sibling temporary file, flushes it
and renames it over the target: a reader sees the old file or the new one,
never a part of either, and a failure (disk full) removes the temporary file.

Locked temporary directories (:func:`locked_tempdir`). A writer that builds a
directory next to its destination (a package, a library build) holds an
exclusive ``flock`` on the temporary directory itself while it works. The
kernel drops that lock when the process ends, however it ends (``kill -9``
included), so a later writer can tell a live temporary directory (locked)
from a stale one (unlocked) without pids or clocks: :func:`sweep_stale`
removes only unlocked directories whose names match the writer's own pattern.
Creating a directory and locking it happen under a short lock on the parent
directory, which the sweep also takes, so a sweep never sees a directory
between its creation and its lock. Where ``flock`` is not supported (some
network file systems) nothing is swept.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from stofc.errors import FileSystemError
from stofc.paths import cache_dir

_FIXES = {
    errno.EROFS: "the file system is read-only; choose a writable location",
    errno.EACCES: "check the permissions of that path, or choose a location you can write",
    errno.EPERM: "check the permissions of that path, or choose a location you can write",
    errno.ENOSPC: "free disk space there, or choose a location on another file system",
    errno.EDQUOT: "free space within your disk quota, or choose another location",
    errno.ENOENT: "check that the path (and its parent directory) exists",
    errno.ENOTDIR: "a part of the path is a file where a directory is needed; fix the path",
    errno.EISDIR: "that path is a directory; give a file name",
    errno.EEXIST: "that path exists already; remove it or choose another",
    errno.ENAMETOOLONG: "use a shorter path",
    errno.ELOOP: "the path has a loop of symbolic links; fix the path",
    errno.EMFILE: "too many open files; raise the limit (ulimit -n) and retry",
    errno.ENFILE: "too many open files on this machine; retry later",
    errno.EIO: "the device reported an I/O error; check the disk",
    errno.ETXTBSY: "the file is in use; retry when the other program is done",
}
LOCK_UNSUPPORTED = (errno.ENOLCK, errno.EBADF, errno.EINVAL, errno.EOPNOTSUPP)


def _in_cache(path: str | None) -> bool:
    if not path:
        return False
    try:
        Path(path).absolute().relative_to(cache_dir().absolute())
    except ValueError:
        return False
    return True


def os_error(err: OSError, *, doing: str | None = None,
             path: str | os.PathLike | None = None) -> FileSystemError:
    """A one-line :class:`FileSystemError` for ``err`` ("cannot DOING: REASON (PATH); FIX")."""
    where = path if path is not None else (err.filename or None)
    reason = err.strerror or (str(err) or type(err).__name__)
    head = f"cannot {doing}" if doing else "file-system error"
    text = f"{head}: {reason}"
    if where is not None:
        text += f" ({os.fspath(where)})"
    other = getattr(err, "filename2", None)
    if other:
        text += f" -> {other}"
    fix = _FIXES.get(err.errno or -1, "check the path and the file system, then retry")
    if _in_cache(os.fspath(where) if where is not None else None):
        fix = (f"{fix}, or set STOFC_CACHE_DIR to a writable directory with free space "
               "(stofc's cache)")
    return FileSystemError(text.replace("\n", " "), hint=fix)


def _full(path: Path) -> bool:
    """The file system holding ``path`` (or its nearest existing parent) has no room left."""
    for candidate in (path, *path.parents):
        try:
            st = os.statvfs(candidate)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize < (64 << 10)
    return False


@contextlib.contextmanager
def fs_errors(doing: str, path: str | os.PathLike | None = None) -> Iterator[None]:
    """Raise :func:`os_error` for any OSError inside the block (``doing``: "write X")."""
    try:
        yield
    except FileSystemError:
        raise
    except OSError as err:
        raise os_error(err, doing=doing, path=path if path is not None else err.filename) \
            from None


def umask() -> int:
    """The process umask (without changing it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object], *,
                 mode: int | None = None, what: str = "write") -> Path:
    """Write ``path`` through ``write(file)`` atomically; returns the path.

    ``mode`` defaults to ``0o666 & ~umask`` (what ``open`` would give). Any
    OSError is a one-line :class:`FileSystemError` naming ``path``; the
    temporary file never outlives a failure. Missing parents are created.
    """
    path = Path(path)
    with fs_errors(f"{what} {path}", path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, (0o666 & ~umask()) if mode is None else mode)
            os.replace(tmp, path)
        except OSError as err:
            if err.errno is None and _full(path.parent):   # judged before the space is freed
                err = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            Path(tmp).unlink(missing_ok=True)
            raise err from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes, **kwargs: Any) -> Path:
    """:func:`atomic_write` of ``data``."""
    return atomic_write(path, lambda f: f.write(data), **kwargs)


def atomic_write_text(path: str | os.PathLike, text: str, **kwargs: Any) -> Path:
    """:func:`atomic_write` of ``text`` (UTF-8)."""
    return atomic_write(path, lambda f: f.write(text.encode()), **kwargs)


# ---------------------------------------------------------------- locked temporary directories


def try_lock(fd: int) -> bool | None:
    """Take an exclusive flock on ``fd`` without waiting: True, False (held by someone),
    None (flock unsupported here)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        if err.errno in LOCK_UNSUPPORTED:
            return None
        raise
    return True


@contextlib.contextmanager
def directory_lock(directory: Path) -> Iterator[bool]:
    """Hold an exclusive flock on ``directory`` (blocking); yields False where the
    directory cannot be opened or locked (then the caller must not sweep)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked = True
        except OSError:
            locked = False
        yield locked
    finally:
        os.close(fd)


def stale_pattern(prefix: str) -> re.Pattern[str]:
    """Names :func:`tempfile.mkdtemp` gives with ``prefix`` (``prefix`` + 8 characters)."""
    return re.compile(re.escape(prefix) + r"[A-Za-z0-9_]{8}")


def sweep_stale(parent: Path, prefixes: tuple[str, ...]) -> list[Path]:
    """Remove the unlocked directories under ``parent`` named ``prefix + 8 characters``
    (what a killed writer left); returns what was removed. Call under
    :func:`directory_lock` of ``parent``."""
    patterns = [stale_pattern(p) for p in prefixes]
    removed: list[Path] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not any(p.fullmatch(entry.name) for p in patterns):
            continue
        if entry.is_symlink() or not entry.is_dir():
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if try_lock(fd):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
        finally:
            os.close(fd)
    return removed


@dataclass
class LockedDir:
    """A temporary directory this process holds locked until :meth:`release`."""

    path: Path
    fd: int | None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def make_locked_tempdir(parent: Path, prefix: str, *,
                        sweep: tuple[str, ...] | None = None) -> LockedDir:
    """``mkdtemp(dir=parent, prefix=prefix)`` locked by this process, after sweeping stale
    siblings named by ``sweep`` (default: ``prefix``). See the module doc."""
    with directory_lock(parent) as locked:
        if locked:
            sweep_stale(parent, sweep or (prefix,))
        path = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
        fd: int | None = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        assert fd is not None
        if not try_lock(fd):
            os.close(fd)
            fd = None
    return LockedDir(path, fd)


@contextlib.contextmanager
def locked_tempdir(parent: Path, prefix: str, *,
                   sweep: tuple[str, ...] | None = None) -> Iterator[Path]:
    """A locked temporary directory under ``parent``, removed (with everything in it)
    when the block ends, however it ends."""
    tmp = make_locked_tempdir(parent, prefix, sweep=sweep)
    try:
        yield tmp.path
    finally:
        shutil.rmtree(tmp.path, ignore_errors=True)
        tmp.release()
