"""Tuning a package written by ``stofc compile``: THE integration point.

Everything ``stofc tune`` checks (GPU name, GPU present, package directory,
database) happens before :func:`tune_package` is called. Then:

1. ``plan.json`` is read (:func:`stofc.package.load.read_plan_document`): the
   plan, the mask formats per layer (``masks/*.npz``), and the original
   model (the path recorded at compile time, hash-checked), whose layers
   the tuner re-partitions and whose shapes the runners build.
2. :func:`stofc.tune.plan_tuner.tune_plan_buckets` tunes every
   sequence-length bucket on the GPU present (real kernels in an isolated
   worker, winners verified against float64 references, everything stored
   in ``db``).
3. :func:`stofc.pipeline.recompile_package` rewrites the package in place,
   atomically (new ``plan.json``, re-rendered and re-compiled kernels, the
   custom-op library, ``manifest.json``), for the tuned plan.

The package's plan (fusion scheme, GEMM and Add+Norm configs) is the largest
bucket's: those kernels take the length at run time. Attention is where the
length changes the best kernel, so every shorter bucket whose tuned attention
config differs becomes a run-time variant of its layer's SparseAttention node,
picked by the actual length (``S <= bucket``; OPS.md "variants"). All buckets'
results are kept in the database, so a later run starts warm.
"""

from __future__ import annotations

from pathlib import Path

from stofc.errors import PackageError
from stofc.targets import GpuProfile
from stofc.tune.db import TuningDatabase
from stofc.tune.progress import Reporter


def tune_package(package_dir: Path, profile: GpuProfile, db: TuningDatabase, reporter: Reporter,
                 *, budget_s: float | None, batch: int, seq_lens: tuple[int, ...],
                 seed: int = 0, check: bool = True) -> None:
    """Tune the package in ``package_dir`` for ``profile`` (see the module doc).

    ``check``: the rewritten package must pass ``stofc compile``'s check (it runs on
    ONNX Runtime's CPU EP and matches the model) before it replaces the old one.
    """
    from stofc.frontend import load_model
    from stofc.frontend.pack import packed_from_document
    from stofc.masks import load as load_format
    from stofc.package.load import plan_of, read_plan_document
    from stofc.package.manifest import check_manifest
    from stofc.package.verify import original_model
    from stofc.pipeline import recompile_package
    from stofc.tune.plan_tuner import tune_plan_buckets

    package_dir = Path(package_dir)
    check_manifest(package_dir)  # first: an edited plan.json is "modified", not a parse error
    doc = read_plan_document(package_dir)
    plan = plan_of(doc, package_dir)
    if plan.arch != profile.arch:
        raise PackageError(f"the package was compiled for {plan.gpu} ({plan.arch}) and the GPU "
                           f"present is an {profile.name} ({profile.arch})",
                           hint=f"compile it again with --gpu {profile.name}, then tune")
    graph = load_model(original_model(package_dir, doc, None),
                       pack_projections=packed_from_document(doc))  # the plan's chain
    formats = {}
    for entry in doc["mask"]["formats"]:
        fmt = load_format(package_dir / entry["npz"])
        formats.update({int(layer): fmt for layer in entry["layers"]})
    lengths = tuple(sorted(set(seq_lens))) or (plan.max_seq_len,)
    tuning = tune_plan_buckets(plan, graph, formats, profile, batch=batch, seq_lens=lengths,
                               budget_s=budget_s, db=db, reporter=reporter, seed=seed)
    recompile_package(package_dir, tuning.plan_for(lengths[-1]), tuned=True,
                      buckets=tuple((n, tuning.plan_for(n)) for n in lengths), check=check)
