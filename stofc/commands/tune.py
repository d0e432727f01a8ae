"""``stofc tune [PACKAGE_DIR] --gpu NAME``: argument checks, then the package tuner."""

from __future__ import annotations

from pathlib import Path

import click

from stofc.errors import PackageError, StofcError
from stofc.pipeline import tune_package
from stofc.targets import get_profile
from stofc.tune.db import TuningDatabase
from stofc.tune.device import check_gpu
from stofc.tune.progress import JsonReporter, QuietReporter, Reporter, RichReporter


def check_package(package_dir: Path) -> Path:
    """The package directory, which must exist and hold ``plan.json``."""
    if not package_dir.exists():
        raise PackageError(f"package directory {package_dir} does not exist",
                           hint="write one with `stofc compile MODEL ...` or name it as PACKAGE_DIR")
    if not package_dir.is_dir():
        raise PackageError(f"{package_dir} is not a directory",
                           hint="PACKAGE_DIR is the directory `stofc compile` wrote")
    if not (package_dir / "plan.json").is_file():
        raise PackageError(f"{package_dir} has no plan.json, so it is not a stofc package",
                           hint="write one with `stofc compile MODEL ...` or name the right directory")
    return package_dir


def choose_reporter(quiet: bool, as_json: bool) -> Reporter:
    """``--json``: JSON lines on stdout; ``--quiet``: warnings only; otherwise rich."""
    if as_json:
        return JsonReporter()
    if quiet:
        return QuietReporter()
    return RichReporter()


@click.command("tune")
@click.argument("package_dir", required=False, default=".",
                type=click.Path(path_type=Path, file_okay=True, dir_okay=True))
@click.option("--gpu", "gpu", required=True, metavar="NAME",
              help="The GPU to tune for (a100, h100, h200, ... or auto); must be the one present.")
@click.option("--budget", "budget", type=float, default=None, metavar="SECONDS",
              help="Stop tuning after this many seconds (default: until converged).")
@click.option("--batch", "batch", type=int, default=1, show_default=True, help="Batch size.")
@click.option("--seq-len", "seq_lens", type=int, multiple=True, metavar="L",
              help="Sequence-length bucket to tune (repeatable).")
@click.option("--db", "db_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Tuning database (default: the user cache directory's tuning.sqlite).")
@click.option("--seed", type=int, default=0, show_default=True, help="Search seed.")
@click.option("--quiet", is_flag=True, help="Print warnings and errors only.")
@click.option("--json", "as_json", is_flag=True, help="Progress and summary as JSON lines.")
@click.option("--no-check", "no_check", is_flag=True,
              help="Do not run the rewritten package against the model on ONNX Runtime's CPU "
                   "EP before it replaces the old one.")
def tune(package_dir: Path, gpu: str, budget: float | None, batch: int,
         seq_lens: tuple[int, ...], db_path: Path | None, seed: int, quiet: bool,
         as_json: bool, no_check: bool) -> None:
    """Tune a compiled package on the GPU present (which must be --gpu NAME)."""
    if budget is not None and budget <= 0:
        raise StofcError(f"--budget {budget:g} is not positive", hint="give seconds, e.g. --budget 60")
    if batch < 1:
        raise StofcError(f"--batch {batch} is not positive", hint="give a batch size >= 1")
    bad = [n for n in seq_lens if n < 1]
    if bad:
        raise StofcError(f"--seq-len {bad[0]} is not positive", hint="give lengths >= 1")
    if gpu.strip().lower() != "auto":
        get_profile(gpu)  # an unknown name is reported before anything else
    check_package(package_dir)
    profile = check_gpu(gpu)
    reporter = choose_reporter(quiet, as_json)
    with TuningDatabase.open(db_path, on_warning=reporter.warning) as db:
        tune_package(package_dir, profile, db, reporter, budget_s=budget, batch=batch,
                     seq_lens=tuple(sorted(set(seq_lens))), seed=seed, check=not no_check)
