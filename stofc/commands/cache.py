"""``stofc cache status|clear``: the compiled-kernel cache and the tuning database."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click

from stofc.errors import StofcError
from stofc.paths import cache_dir
from stofc.targets import get_profile, profile_for_device_name
from stofc.tune.db import TuningDatabase, default_path


def kernels_dir() -> Path:
    """Where :mod:`stofc.compile.nvrtc` caches binaries."""
    return cache_dir() / "kernels"


def _tree_size(root: Path) -> tuple[int, int]:
    """(files, bytes) under ``root``; (0, 0) when it does not exist."""
    files = size = 0
    if root.is_dir():
        for path in root.rglob("*"):
            if path.is_file():
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
    kernels = kernels_dir()
    files, size = _tree_size(kernels)
    db_file = db_path or default_path()
    tuning: dict = {"path": str(db_file), "exists": db_file.is_file(), "bytes": 0, "gpus": {}}
    if db_file.is_file():
        with TuningDatabase.open(db_file) as db:
            tuning["gpus"] = {gpu: {"records": r, "samples": s}
                              for gpu, (r, s) in db.counts_by_gpu().items()}
        tuning["bytes"] = _db_size(db_file)
    return {"cache_dir": str(cache_dir()),
            "kernels": {"path": str(kernels), "files": files, "bytes": size},
            "tuning": tuning}


@click.group("cache")
def cache() -> None:
    """Inspect or clear the compiled-kernel cache and the tuning database."""


@cache.command("status")
@click.option("--db", "db_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Tuning database (default: the user cache directory's tuning.sqlite).")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(db_path: Path | None, as_json: bool) -> None:
    """Locations, sizes and record counts (per GPU) of the caches."""
    info = cache_status(db_path)
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    kernels, tuning = info["kernels"], info["tuning"]
    click.echo(f"cache directory: {info['cache_dir']}")
    click.echo(f"compiled kernels: {kernels['path']}: {kernels['files']} files, "
               f"{_human(kernels['bytes'])}")
    if not tuning["exists"]:
        click.echo(f"tuning database: {tuning['path']}: not created yet")
        return
    total = sum(g["records"] for g in tuning["gpus"].values())
    click.echo(f"tuning database: {tuning['path']}: {_human(tuning['bytes'])}, "
               f"{total} records")
    for gpu, counts in tuning["gpus"].items():
        click.echo(f"  {gpu}: {counts['records']} records, {counts['samples']} samples")


@cache.command("clear")
@click.option("--db", "db_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Tuning database (default: the user cache directory's tuning.sqlite).")
@click.option("--kernels", is_flag=True, help="Clear the compiled-kernel cache.")
@click.option("--tuning", is_flag=True, help="Clear the tuning database.")
@click.option("--gpu", "gpu", default=None, metavar="NAME",
              help="With --tuning: only the records measured on this GPU (h100, h200, ...).")
@click.option("--yes", is_flag=True, help="Confirm: really delete.")
def clear(db_path: Path | None, kernels: bool, tuning: bool, gpu: str | None, yes: bool) -> None:
    """Delete cached kernels and/or tuning records (both unless one is named)."""
    profile = None
    if gpu is not None:
        if kernels:
            raise StofcError("--gpu selects tuning records; the kernel cache is not per GPU",
                             hint="use --gpu with --tuning only")
        profile = get_profile(gpu)
        tuning = True
    if not kernels and not tuning:
        kernels = tuning = True
    what = " and ".join(n for n, on in (("compiled kernels", kernels),
                                         ("tuning records", tuning)) if on)
    if not yes:
        raise StofcError(f"not clearing the {what} without confirmation",
                         hint="add --yes to delete them")
    if kernels:
        root = kernels_dir()
        files, size = _tree_size(root)
        if root.is_dir():
            shutil.rmtree(root)
        click.echo(f"cleared compiled kernels: {files} files, {_human(size)} ({root})")
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

