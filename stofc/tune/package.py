"""Tuning a package written by ``stofc compile``: THE integration point.

Everything ``stofc tune`` checks (GPU name, GPU present, package directory,
database) happens before :func:`tune_package` is called; this function is the
only place that knows the package format. It is not wired yet because the
package format (``plan.json``) and the kernel families' segment spaces are
being written in other issues; until then it says so instead of pretending.

What it must do once those exist (the engine parts are done and tested):

1. ``plan = stofc.plan.load(package_dir / "plan.json")``: the layer chains
   and their attention blocks.
2. For each (batch, seq_len) bucket and each distinct layer chain:
   ``space = stofc.plan.scheme_space(chain, profile, batch=..., seq_len=...)``
   (a :class:`~stofc.tune.interfaces.SchemeSpace`; its segments are the kernel
   families' :class:`~stofc.tune.interfaces.SegmentSpace` objects, the
   attention segment among them).
3. One :class:`~stofc.tune.measure.WorkerMeasurer` (runner: the CuPy segment
   runner in ``stofc.runtime``, payload: the segment's kernel spec and shapes,
   inputs rotated past ``profile.l2_bytes`` with
   :func:`~stofc.tune.measure.rotation_count`) and one
   :class:`~stofc.tune.evaluate.Evaluator` over it and ``db``, shared by all
   chains so equal segments are measured once.
4. ``stofc.tune.engine.tune_chain(space, measurer, reporter, db=db,
   budget_s=..., evaluator=evaluator)`` per chain, the budget split among
   buckets.
5. Rewrite the package (``stofc.package``) with the tuned schemes and configs,
   one entry per sequence-length bucket.
"""

from __future__ import annotations

from pathlib import Path

from stofc.errors import StofcError
from stofc.targets import GpuProfile
from stofc.tune.db import TuningDatabase
from stofc.tune.progress import Reporter


def tune_package(package_dir: Path, profile: GpuProfile, db: TuningDatabase, reporter: Reporter,
                 *, budget_s: float | None, batch: int, seq_lens: tuple[int, ...],
                 seed: int = 0) -> None:
    """Tune the package in ``package_dir`` for ``profile`` (see the module doc)."""
    raise StofcError(
        f"the checks passed (package {package_dir}, GPU {profile.name}, database {db.path}) "
        "but tuning a package is not wired yet: the plan.json reader and the kernel families' "
        "search spaces are still being written",
        hint="the tuning engine itself is in stofc.tune (see stofc/tune/package.py)")
