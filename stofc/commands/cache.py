"""``stofc cache status|clear``: every cache stofc keeps, in one place.

=====================  ===================================================================
cache                  what it holds
=====================  ===================================================================
``kernels/``           compiled cubins and PTX (:mod:`stofc.compile.nvrtc`)
``ortlib/``            built custom-op libraries (:mod:`stofc.package.ortlib`)
``ort-headers/``       ONNX Runtime API headers fetched through apt
                       (:mod:`stofc.package.ort_headers`)
``tuning.sqlite``      the tuning database (:mod:`stofc.tune.db`), or ``--db``
=====================  ===================================================================

Every entry is content-checked on read (:mod:`stofc.cachecheck`); ``clear``
is the way out when a user wants the space back or distrusts a cache. Clearing
skips the temporary build directories of a build that is running right now
(they are locked; see :mod:`stofc.fsutil`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import click

from stofc.errors import StofcError
from stofc.fsutil import fs_errors, try_lock
from stofc.paths import cache_dir
from stofc.targets import get_profile, profile_for_device_name
from stofc.tune.db import TuningDatabase, default_path

# name in status/JSON -> (sub-directory, what a line calls it)
DIRECTORIES: dict[str, tuple[str, str]] = {
    "kernels": ("kernels", "compiled kernels"),
    "ortlib": ("ortlib", "custom-op libraries"),
    "ort_headers": ("ort-headers", "ONNX Runtime headers"),
}


def kernels_dir() -> Path:
    """Where :mod:`stofc.compile.nvrtc` caches binaries."""
    return cache_dir() / "kernels"


def _tree_size(root: Path) -> tuple[int, int]:
    """(files, bytes) under ``root``; (0, 0) when it does not exist."""
    files = size = 0
    if root.is_dir():
        for path in root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                files += 1
                size += path.stat().st_size
    return files, size


def _db_size(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal"))
               if p.is_file())


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def cache_status(db_path: Path | None) -> dict:
    """Where the caches are, how big, and the tuning records per GPU (no file is created)."""
    out: dict = {"cache_dir": str(cache_dir())}
    for name, (sub, _) in DIRECTORIES.items():
        files, size = _tree_size(cache_dir() / sub)
        out[name] = {"path": str(cache_dir() / sub), "files": files, "bytes": size}
    db_file = db_path or default_path()
    tuning: dict = {"path": str(db_file), "exists": db_file.is_file(), "bytes": 0, "gpus": {}}
    if db_file.is_file():
        with TuningDatabase.open(db_file) as db:
            tuning["gpus"] = {gpu: {"records": r, "samples": s}
                              for gpu, (r, s) in db.counts_by_gpu().items()}
        tuning["bytes"] = _db_size(db_file)
    out["tuning"] = tuning
    return out


@click.group("cache")
def cache() -> None:
    """Inspect or clear stofc's caches: compiled kernels, custom-op libraries, ONNX Runtime
    headers and the tuning database."""


@cache.command("status")
@click.option("--db", "db_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Tuning database (default: the user cache directory's tuning.sqlite).")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(db_path: Path | None, as_json: bool) -> None:
    """Locations, sizes and record counts (per GPU) of every cache."""
    info = cache_status(db_path)
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    click.echo(f"cache directory: {info['cache_dir']}")
    for name, (_, label) in DIRECTORIES.items():
        entry = info[name]
        click.echo(f"{label}: {entry['path']}: {entry['files']} files, {_human(entry['bytes'])}")
    tuning = info["tuning"]
    if not tuning["exists"]:
        click.echo(f"tuning database: {tuning['path']}: not created yet")
        return
    total = sum(g["records"] for g in tuning["gpus"].values())
    click.echo(f"tuning database: {tuning['path']}: {_human(tuning['bytes'])}, "
               f"{total} records")
    for gpu, counts in tuning["gpus"].items():
        click.echo(f"  {gpu}: {counts['records']} records, {counts['samples']} samples")


def _clear_directory(root: Path) -> tuple[int, int]:
    """Remove everything under ``root`` except a running build's locked directory."""
    files, size = _tree_size(root)
    if not root.is_dir():
        return files, size
    for entry in root.iterdir():
        if entry.is_dir() and not entry.is_symlink() and entry.name.startswith("."):
            fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
            try:
                if try_lock(fd) is False:
                    left = _tree_size(entry)
                    files, size = files - left[0], size - left[1]
                    continue  # a build that is running now
            finally:
                os.close(fd)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    if not any(root.iterdir()):
        root.rmdir()
    return files, size


@cache.command("clear")
@click.option("--db", "db_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Tuning database (default: the user cache directory's tuning.sqlite).")
@click.option("--kernels", is_flag=True, help="Clear the compiled-kernel cache.")
@click.option("--ortlib", is_flag=True, help="Clear the custom-op library cache.")
@click.option("--headers", is_flag=True, help="Clear the fetched ONNX Runtime headers.")
@click.option("--tuning", is_flag=True, help="Clear the tuning database.")
@click.option("--gpu", "gpu", default=None, metavar="NAME",
              help="With --tuning: only the records measured on this GPU (h100, h200, ...).")
@click.option("--yes", is_flag=True, help="Confirm: really delete.")
def clear(db_path: Path | None, kernels: bool, ortlib: bool, headers: bool, tuning: bool,
          gpu: str | None, yes: bool) -> None:
    """Delete cached kernels, libraries, headers and/or tuning records (all unless named)."""
    profile = None
    if gpu is not None:
        if kernels or ortlib or headers:
            raise StofcError("--gpu selects tuning records; the kernel, library and header "
                             "caches are not per GPU", hint="use --gpu with --tuning only")
        profile = get_profile(gpu)
        tuning = True
    chosen = {"kernels": kernels, "ortlib": ortlib, "ort_headers": headers}
    if not any(chosen.values()) and not tuning:
        chosen = dict.fromkeys(chosen, True)
        tuning = True
    names = [*(DIRECTORIES[n][1] for n, on in chosen.items() if on),
             *(["tuning records"] if tuning else [])]
    what = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    if not yes:
        raise StofcError(f"not clearing the {what} without confirmation",
                         hint="add --yes to delete them")
    for name, on in chosen.items():
        if not on:
            continue
        sub, label = DIRECTORIES[name]
        root = cache_dir() / sub
        with fs_errors(f"clear {root}", root):
            files, size = _clear_directory(root)
        click.echo(f"cleared {label}: {files} files, {_human(size)} ({root})")
    if tuning:
        db_file = db_path or default_path()
        if not db_file.is_file():
            click.echo(f"no tuning database at {db_file}")
            return
        with TuningDatabase.open(db_file) as db:
            if profile is None:
                deleted = db.clear()
            else:
                names = [n for n in db.counts_by_gpu() if profile_for_device_name(n) is profile]
                deleted = sum(db.clear(n) for n in names)
            db.compact()
        scope = "" if gpu is None else f" for {gpu}"
        click.echo(f"cleared tuning database{scope}: {deleted} rows ({db_file})")
