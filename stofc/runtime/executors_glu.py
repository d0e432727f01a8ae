"""How the CuPy segment runner launches a gated activation alone (family ``glu``).

The gated FFN's projections (``vendor_glu``, ``gemm_glu``) are in
:mod:`stofc.runtime.executors`; a scheme that splits the gated activation from its GEMM
runs it here, the gated-activation kernel (``gemm/glu.cu.j2``) over ``[tokens, 2F]``
with the bias when the segment has one. Imported by :mod:`stofc.runtime.segments`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from stofc.kernels import glu as glu_family
from stofc.plan.plan import Segment
from stofc.runtime.executors import Loaded, SegmentExecutor, _problem, executes

if TYPE_CHECKING:
    from stofc.runtime.segments import SegmentRunner


@executes
class GatedExecutor(SegmentExecutor):
    """The gated-activation kernel on a ``glu`` segment (bias?, gated)."""

    families = ("glu",)

    def compile(self, runner: SegmentRunner, seg: Segment) -> Loaded:
        _, problem, cfg = _problem(seg, runner.dtype)
        fn = runner.load(glu_family.render_gated(problem, cfg), 0)
        return Loaded(fn, 0, cfg.tpr * cfg.rows, cfg)

    def run(self, runner: SegmentRunner, loaded: Loaded, seg: Segment, values: dict[str, Any],
            *, batch: int, seq_len: int, stream: Any) -> None:
        m, n = batch * seq_len, seg.dim("n")
        x = runner._get(values, seg, "x", (m, n))
        bias = runner._get(values, seg, "bias", (n,))
        out = runner._empty((m, n // 2))
        loaded.function((-(-m // loaded.config.rows), 1, 1), (loaded.threads, 1, 1),
                        (x, bias, out, np.int32(m), np.int32(n // 2)), stream=stream)
        runner._store(values, seg, out, None)
