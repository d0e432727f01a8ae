"""The compile stage: every rendered kernel for every package target, in parallel threads.

NVRTC releases the GIL while it compiles, so a thread per job keeps the cores busy;
results come from the content-addressed cache (:func:`~stofc.compile.nvrtc.compile_source`)
when present. No GPU is touched.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from stofc.codegen import RenderedKernel
from stofc.compile.nvrtc import CompiledKernel, compile_source


def compile_kernels(kernels: Sequence[RenderedKernel], targets: tuple[str, ...], *,
                    workers: int | None = None) -> dict[tuple[str, str], CompiledKernel]:
    """Compile each distinct kernel (by name) for each package target;
    ``{(name, target): compiled}`` (its ``target`` is the NVRTC target actually used).

    Raises :class:`~stofc.errors.CompileError` (NVRTC's log and the dumped source)
    for the first kernel that fails.
    """
    unique = {k.name: k for k in kernels}
    jobs = [(k, t) for k in unique.values() for t in targets]
    if not jobs:
        return {}
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        done = list(pool.map(lambda job: compile_source(job[0].source, job[0].nvrtc_target(job[1]),
                                                        options=job[0].options), jobs))
    return {(k.name, t): c for (k, t), c in zip(jobs, done, strict=True)}
