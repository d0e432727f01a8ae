"""A GPU self-check of the measurement machinery: ``python -m stofc.tune.probe``.

Runs a tiny ``y = 2x + 1`` kernel through :class:`~stofc.tune.measure.WorkerMeasurer`
on the GPU present and checks, in one run, what the tuner relies on:

* good configs time (CUDA events, warm-up, median) over input sets rotated
  past L2 (the achieved bandwidth must not exceed the profile's DRAM figure
  by more than 25%, which it would if the data sat in L2);
* a config writing to an illegal address is recorded as a fault and the
  worker replaced; the next good config times as before (no poisoning);
* a config that never finishes is stopped by the timeout, the same way;
* ``verify`` compares the output with the NumPy reference.

It prints one JSON object and exits 1 if any check failed. The kernel is
compiled with :func:`stofc.compile.nvrtc.compile_source` (the project's
path) and loaded as a cubin, as the real runners do. The runner
(:func:`run_probe_task`) is also a worked example of the runner contract.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from stofc.codegen import Source
from stofc.compile.nvrtc import compile_source
from stofc.errors import StofcError
from stofc.targets import detect
from stofc.tune.interfaces import Config
from stofc.tune.measure import (
    MeasureTask,
    TimingSettings,
    WorkerMeasurer,
    rotation_count,
    time_with_events,
)

PROBE_SOURCE = Source(
    name="stofc_probe",
    code=r'''
extern "C" __global__ void stofc_probe_axpb(const float* __restrict__ x, float* __restrict__ y,
                                            long long n, int mode) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (mode == 2) {
        for (;;) { asm volatile("nanosleep.u32 1000;"); }
    }
    if (i < n) {
        float v = 2.0f * x[i] + 1.0f;
        if (mode == 1) {
            y[i + (1ll << 40)] = v;
        } else {
            y[i] = v;
        }
    }
}
''',
    template="inline",
    entry_points=("stofc_probe_axpb",),
)
MODES = {"ok": 0, "illegal": 1, "hang": 2}

_CACHE: dict[str, Any] = {}


def _function() -> Any:
    """Compile (cached on disk) and load the probe kernel once per worker process."""
    if "fn" not in _CACHE:
        import cupy  # optional: CuPy, the GPU extras


        kernel = compile_source(PROBE_SOURCE, detect().arch)
        path = Path(tempfile.mkdtemp(prefix="stofc-probe-")) / "probe.cubin"
        path.write_bytes(kernel.binary)
        _CACHE["module"] = cupy.RawModule(path=str(path))
        _CACHE["fn"] = _CACHE["module"].get_function("stofc_probe_axpb")
    return _CACHE["fn"]


def _buffers(n: int, sets: int) -> tuple[list[Any], list[Any]]:
    key = f"buf{n}x{sets}"
    if key not in _CACHE:
        import cupy  # optional: CuPy, the GPU extras

        rng = cupy.random.default_rng(0)
        xs = [rng.random(n, dtype=cupy.float32) + 0.5 for _ in range(sets)]
        ys = [cupy.full(n, cupy.nan, dtype=cupy.float32) for _ in range(sets)]
        _CACHE[key] = (xs, ys)
    return _CACHE[key]


def run_probe_task(task: MeasureTask) -> float | bool:
    """The runner: ``payload = {"n": elements, "sets": input sets}``; config threads, mode."""
    import cupy  # optional: CuPy, the GPU extras


    config = task.params
    threads, mode = int(config["threads"]), MODES[str(config["mode"])]
    n, sets = int(task.payload["n"]), int(task.payload["sets"])
    fn = _function()
    xs, ys = _buffers(n, sets)
    grid = (n + threads - 1) // threads

    def launch(i: int) -> None:
        fn((grid,), (threads,), (xs[i], ys[i], np.int64(n), np.int32(mode)))

    if task.mode == "verify":
        ys[0].fill(cupy.nan)  # poison: a kernel that writes nothing cannot pass
        launch(0)
        cupy.cuda.Device().synchronize()
        expect = 2.0 * cupy.asnumpy(xs[0]).astype(np.float64) + 1.0
        return bool(np.allclose(cupy.asnumpy(ys[0]), expect, rtol=1e-6, atol=0))
    ms = time_with_events(launch, sets, task.settings)
    cupy.cuda.Device().synchronize()
    return ms


def main() -> int:
    """Run the checks on the GPU present; print one JSON object; 0 if all passed."""

    try:
        profile = detect()
    except StofcError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n = 1 << 23                                    # 32 MiB in + 32 MiB out per set
    sets = rotation_count(8 * n, profile.l2_bytes)
    segment = _ProbeSegment(payload={"n": n, "sets": sets})
    report: dict[str, Any] = {"gpu": profile.name, "n": n, "sets": sets, "checks": {}}
    checks = report["checks"]
    with WorkerMeasurer("stofc.tune.probe:run_probe_task", timeout_s=5.0,
                        settings=TimingSettings(warmup=3, repeats=20)) as measurer:
        report["device"] = {"gpu": measurer.gpu, "driver": measurer.driver}
        ok128 = measurer.measure(segment, Config.of(threads=128, mode="ok"))
        ok256 = measurer.measure(segment, Config.of(threads=256, mode="ok"))
        illegal = measurer.measure(segment, Config.of(threads=256, mode="illegal"))
        after_illegal = measurer.measure(segment, Config.of(threads=128, mode="ok"))
        hang = measurer.measure(segment, Config.of(threads=256, mode="hang"))
        after_hang = measurer.measure(segment, Config.of(threads=256, mode="ok"))
        verified = measurer.verify(segment, Config.of(threads=256, mode="ok"))
        report["replacements"] = measurer.replacements
    times = {"ok128": ok128, "ok256": ok256, "illegal": illegal, "after_illegal": after_illegal,
             "hang": hang, "after_hang": after_hang}
    report["measurements"] = {k: {"time_ms": m.time_ms, "fault": m.fault} for k, m in times.items()}
    checks["good configs time"] = ok128.ok and ok256.ok
    checks["illegal address is a fault"] = "llegal" in (illegal.fault or "")
    checks["hang is a timeout"] = (hang.fault or "").startswith("timeout")
    checks["no poisoning after the illegal address"] = (
        ok128.ok and after_illegal.ok and abs(after_illegal.score / ok128.score - 1) < 0.25)
    checks["no poisoning after the timeout"] = (
        ok256.ok and after_hang.ok and abs(after_hang.score / ok256.score - 1) < 0.25)
    checks["verify against the reference"] = verified
    checks["two workers replaced"] = report["replacements"] == 2
    if ok256.ok:
        gbs = 8 * n / (ok256.score * 1e-3) / 1e9
        report["achieved_gbs"] = gbs
        checks["inputs rotated past L2"] = gbs <= 1.25 * profile.mem_bandwidth_gbs
    report["passed"] = all(checks.values())
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


class _ProbeSegment:
    """The probe as a :class:`~stofc.tune.interfaces.SegmentSpace` (configs listed in ``main``)."""

    family = "probe"
    problem: tuple = ("probe",)
    compile_options: tuple[str, ...] = ()
    label = "probe"

    def __init__(self, payload: dict) -> None:
        self.payload = payload

    def configs(self) -> list[Config]:
        return [Config.of(threads=t, mode=m) for t in (128, 256) for m in MODES]

    def default_config(self) -> Config:
        return Config.of(threads=256, mode="ok")

    def prune_reasons(self) -> dict[str, int]:
        return {}


if __name__ == "__main__":
    sys.exit(main())
