"""The GPU runners the tuner measures real kernels with (worker-side entry points).

:class:`~stofc.tune.measure.WorkerMeasurer` names these module-level functions:

* :func:`run` (``RUNNER``): one :class:`~stofc.tune.measure.MeasureTask`:
  the attention segment goes to :mod:`stofc.tune.runner_attention`, every
  other family (GEMM+epilogue with the hand-written template or the vendor
  cuBLAS/cuBLASLt path, GEMM+Norm, GEMM+GEMM, Add+Norm) to
  :mod:`stofc.tune.runner_segments`. Median ms for ``"time"``, the float64
  reference check for ``"verify"``.
* :func:`compile_candidate` (``COMPILER``): renders and compiles one candidate
  into the NVRTC cache without a GPU (the compile pool runs it in parallel).
* :func:`describe`: the GPU and driver measured on; refuses cleanly (a
  one-line :class:`~stofc.errors.DeviceError`) where no CUDA GPU exists, so a
  measurer on such a machine fails at start with that line, never mid-search.

:func:`gpu_measurer` builds the measurer wired to all three.
"""

from __future__ import annotations

from typing import Any

from stofc.errors import DeviceError
from stofc.tune import runner_attention, runner_segments
from stofc.tune.measure import MeasureTask, TimingSettings, WorkerMeasurer, device_identity
from stofc.tune.runner_attention import compile_attention
from stofc.tune.runner_segments import compile_segment
from stofc.tune.spaces import AttentionPayload, SegmentPayload

RUNNER = "stofc.tune.runners:run"
COMPILER = "stofc.tune.runners:compile_candidate"

_GPU_OK: list[bool] = []


def require_gpu() -> None:
    """Raise a one-line :class:`DeviceError` unless a CUDA GPU is usable here."""
    if _GPU_OK:
        return
    try:
        import cupy  # optional: CuPy, the GPU extras
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as err:
        raise DeviceError(f"the tuning runners time kernels on a CUDA GPU and none is usable "
                          f"here ({type(err).__name__})",
                          hint="run `stofc tune` on the target GPU; `stofc compile` works "
                               "without one") from None
    if count < 1:
        raise DeviceError("the tuning runners time kernels on a CUDA GPU and none was found",
                          hint="run `stofc tune` on the target GPU; `stofc compile` works "
                               "without one")
    _GPU_OK.append(True)


def describe() -> dict[str, str]:
    """The device measured on (``gpu``, ``driver``); a DeviceError without a GPU."""
    require_gpu()
    return device_identity()


def run(task: MeasureTask) -> float | bool:
    """Time or verify one candidate of a real kernel family (see the module doc)."""
    require_gpu()
    if isinstance(task.payload, AttentionPayload):
        return runner_attention.run(task)
    if isinstance(task.payload, SegmentPayload):
        return runner_segments.run(task)
    raise TypeError(f"no runner for a {type(task.payload).__name__} payload "
                    f"(family {task.family!r})")


def compile_candidate(payload: Any, config_key: str) -> None:
    """Compile one candidate into the NVRTC cache; raises its compile error (no GPU)."""
    if isinstance(payload, AttentionPayload):
        compile_attention(payload, config_key)
    elif isinstance(payload, SegmentPayload):
        compile_segment(payload, config_key)
    else:
        raise TypeError(f"no compiler for a {type(payload).__name__} payload")


def gpu_measurer(*, timeout_s: float = 20.0, settings: TimingSettings | None = None,
                 compile_workers: int | None = None) -> WorkerMeasurer:
    """A :class:`WorkerMeasurer` over :func:`run` with the compile pool on :func:`compile_candidate`."""
    return WorkerMeasurer(RUNNER, timeout_s=timeout_s, settings=settings or TimingSettings(),
                          compiler=COMPILER,
                          compile_workers=compile_workers)
