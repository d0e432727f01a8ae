"""The render stage: every kernel a package (or a runner) builds, through its family.

:func:`render_kernels` renders each :class:`~stofc.kernels.registry.KernelInstance`
with its family's templates (one Jinja2 environment with ``StrictUndefined``,
:mod:`stofc.codegen`) and records how the family compiles it: NVRTC options and
the NVRTC target per package target. No GPU; nothing is compiled here
(:func:`stofc.compile.batch.compile_kernels` is next).
"""

from __future__ import annotations

from collections.abc import Sequence

from stofc.codegen import RenderedKernel
from stofc.kernels import catalog
from stofc.kernels.registry import KernelInstance


def render_kernel(kernel: KernelInstance, targets: Sequence[str]) -> RenderedKernel:
    """``kernel`` rendered, with its compile options and NVRTC target per package target."""
    fam = catalog.family(kernel.family)
    return RenderedKernel(fam.render(kernel), tuple(fam.compile_options),
                          tuple((t, fam.nvrtc_target(kernel, t)) for t in targets))


def render_kernels(kernels: Sequence[KernelInstance], targets: Sequence[str]
                   ) -> tuple[RenderedKernel, ...]:
    """Every kernel rendered (see :func:`render_kernel`), in order."""
    return tuple(render_kernel(k, targets) for k in kernels)
