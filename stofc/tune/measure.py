"""Trusted measurement: candidates run in a worker process, timed with CUDA events.

Isolation (:class:`WorkerMeasurer`): every candidate runs in one long-lived
worker process started with ``multiprocessing`` *spawn*, so CUDA is
initialised only there (never in the tuner). The tuner sends a
:class:`MeasureTask` and waits at most ``timeout_s``. Then:

* a result: recorded; the worker is reused;
* the runner raised :class:`CandidateRejected` (the config cannot run, e.g.
  too much shared memory): recorded as a fault; the worker is reused;
* the runner raised anything else (a CUDA illegal address or launch failure
  leaves the context unusable): recorded as a fault; the worker is replaced;
* the worker died (segfault, ``abort``) or did not answer in time: killed,
  recorded as a fault; the worker is replaced.

So a faulting candidate never stops the search and never poisons a later
measurement (the next one runs in a fresh CUDA context).

Compilation needs no GPU, so it runs beside the GPU worker: with a
``compiler`` (see :mod:`stofc.tune.compile_pool`), :meth:`WorkerMeasurer.prepare`
compiles many candidates (of several segments) at once in ``compile_workers``
processes, and a candidate that fails to compile is a fault that never reaches
the GPU worker. The engine calls ``prepare`` before each stage-1 move and each
stage-2 round (:meth:`~stofc.tune.evaluate.Evaluator.prefetch`).

The runner: a module-level function named ``"package.module:function"``,
called in the worker as ``function(task) -> float | bool`` (the median time
in ms for ``task.mode == "time"``, the reference check for ``"verify"``). The
same module may define ``describe() -> dict(gpu=..., driver=...)``;
otherwise :func:`device_identity` asks CUDA. Runners time with
:func:`time_with_events` over input sets rotated past L2
(:func:`rotation_count`).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import multiprocessing
import os
import re
import signal
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from stofc.errors import DeviceError
from stofc.paths import cache_dir
from stofc.tune.compile_pool import CompilePool, one_line
from stofc.tune.interfaces import Config, Measurement, SegmentSpace


class CandidateRejected(Exception):
    """Raised by a runner for a config that cannot run but leaves the GPU healthy."""


@dataclass(frozen=True)
class TimingSettings:
    """How a runner times: warm-up launches, timed repeats, launches per repeat."""

    warmup: int = 3
    repeats: int = 20
    inner: int = 1


@dataclass(frozen=True)
class MeasureTask:
    """What the worker receives: which config of which segment, and how to time it.

    ``payload`` is whatever the family's runner needs to build and launch the
    kernel (sources, shapes, the mask arrays' recipe); it must pickle.
    """

    mode: Literal["time", "verify"]
    family: str
    problem: tuple
    config: str
    payload: Any
    settings: TimingSettings = TimingSettings()

    @property
    def params(self) -> Config:
        return Config.from_key(self.config)


def rotation_count(bytes_per_set: int, l2_bytes: int, *, limit: int = 64) -> int:
    """How many input sets to rotate so consecutive launches never hit in L2.

    Enough sets to cover twice the L2 size (at least 2), at most ``limit``.
    """
    if bytes_per_set <= 0:
        raise ValueError("bytes_per_set must be positive")
    return max(2, min(limit, math.ceil(2 * l2_bytes / bytes_per_set) + 1))


def time_with_events(launch: Callable[[int], None], n_inputs: int,
                     settings: TimingSettings = TimingSettings()) -> float:
    """Median ms per launch of ``launch(i)`` (``i`` = input set), timed with CUDA events.

    Warm-up first; each repeat records an event pair around ``settings.inner``
    launches on successive input sets. Raises on any CUDA error (the worker
    turns it into a fault). GPU only; call it inside a runner.
    """
    import cupy  # optional: CuPy, the GPU extras

    index = 0
    for _ in range(settings.warmup):
        launch(index % n_inputs)
        index += 1
    cupy.cuda.Device().synchronize()
    samples = []
    for _ in range(settings.repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(settings.inner):
            launch(index % n_inputs)
            index += 1
        end.record()
        end.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, end) / settings.inner)
    return float(statistics.median(samples))


def driver_release(proc_file: Path = Path("/proc/driver/nvidia/version")) -> str | None:
    """The NVIDIA kernel driver release (``"580.65.06"``) from ``/proc``, or None."""
    try:
        text = proc_file.read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return match.group(1) if match else None


def device_identity() -> dict[str, str]:
    """The name and driver of CUDA device 0 (called inside the worker).

    ``driver`` is the driver release and the CUDA version it supports
    (``"580.65.06/cuda13.0"``); the release alone is unavailable in
    containers without ``/proc/driver/nvidia``.
    """
    import cupy  # optional: CuPy, the GPU extras

    props = cupy.cuda.runtime.getDeviceProperties(0)
    raw = props["name"]
    name = raw.decode() if isinstance(raw, bytes) else str(raw)
    version = cupy.cuda.runtime.driverGetVersion()
    cuda = f"cuda{version // 1000}.{(version % 1000) // 10}"
    release = driver_release()
    return {"gpu": name, "driver": f"{release}/{cuda}" if release else cuda}


def _resolve(ref: str) -> tuple[Callable[[MeasureTask], Any], Callable[[], dict]]:
    module_name, _, attr = ref.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr), getattr(module, "describe", device_identity)


def _worker_main(conn: Any, runner_ref: str) -> None:
    """The worker loop: ``("ready", identity)``, then one answer per task until EOF."""
    try:
        run, describe = _resolve(runner_ref)
        conn.send(("ready", describe()))
    except BaseException as err:
        conn.send(("failed", one_line(err)))
        return
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        try:
            conn.send(("ok", run(task)))
        except CandidateRejected as err:
            conn.send(("rejected", str(err) or "rejected"))
        except BaseException as err:
            conn.send(("fault", one_line(err)))


class GpuLock:
    """An exclusive file lock held while a candidate runs, so two tuners on one
    machine never time at the same moment (their kernels would share the GPU and
    both timings would be wrong). Re-entrant within a process is not needed:
    one measurer holds it around one candidate at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def __enter__(self) -> GpuLock:
        import fcntl  # optional: POSIX only

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        import fcntl  # optional: POSIX only

        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def default_lock_path() -> Path:
    """One lock per machine under the cache directory (all GPUs: simple and safe)."""
    return cache_dir() / "locks" / "measure.lock"


class WorkerUnavailable(DeviceError):
    """The worker could not start (runner import failed, no GPU): the search cannot go on.

    A user error (exit code 2 through the CLI), not a candidate's fault."""

    def __init__(self, message: str) -> None:
        super().__init__(message, hint="check that the GPU works (python -m stofc.tune.probe)")


class _Worker:
    def __init__(self, runner_ref: str, start_timeout_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, runner_ref), daemon=True,
                                   name="stofc-measure")
        self.process.start()
        child.close()
        if not self.conn.poll(start_timeout_s):
            self.kill()
            raise WorkerUnavailable(f"measurement worker did not start in {start_timeout_s:.0f} s")
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise WorkerUnavailable("measurement worker died while starting") from None
        if status != "ready":
            self.kill()
            raise WorkerUnavailable(f"measurement worker failed to start: {value}")
        self.identity: dict[str, str] = dict(value)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(2)
        self.kill()


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"worker died ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"worker died (signal {-exitcode})"
    return f"worker died (exit code {exitcode})"


class WorkerMeasurer:
    """A :class:`~stofc.tune.interfaces.Measurer` that isolates candidates in a worker.

    ``runner``: ``"module:function"`` (see the module doc). ``payload_of``:
    turns a segment into the picklable payload the runner needs (default: the
    segment's ``payload`` attribute, else None). ``timeout_s``: per candidate.
    ``replacements`` counts workers replaced after faults. ``lock_path``: the
    :class:`GpuLock` file held while each candidate runs (default
    :func:`default_lock_path`; None: no lock).
    """

    def __init__(self, runner: str, *, timeout_s: float = 10.0, start_timeout_s: float = 120.0,
                 payload_of: Callable[[SegmentSpace], Any] | None = None,
                 settings: TimingSettings = TimingSettings(), compiler: str | None = None,
                 compile_workers: int | None = None,
                 lock_path: Path | Literal["default"] | None = "default") -> None:
        self.runner = runner
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.payload_of = payload_of or (lambda segment: getattr(segment, "payload", None))
        self.settings = settings
        self.replacements = 0
        self.worker_pids: list[int] = []
        self._worker: _Worker | None = None
        self.compiler = compiler
        self.compile_workers = compile_workers or max(1, (os.cpu_count() or 2) - 1)
        self._compiler = (CompilePool(compiler, self.compile_workers, self.payload_of)
                          if compiler else None)
        self.lock_path = default_lock_path() if lock_path == "default" else lock_path

    def _ensure(self) -> _Worker:
        if self._worker is None:
            self._worker = _Worker(self.runner, self.start_timeout_s)
            self.worker_pids.append(self._worker.process.pid or -1)
        return self._worker

    @property
    def gpu(self) -> str:
        return self._ensure().identity["gpu"]

    @property
    def driver(self) -> str:
        return self._ensure().identity["driver"]

    def _replace(self) -> None:
        if self._worker is not None:
            self._worker.kill()
            self._worker = None
            self.replacements += 1

    def _call(self, task: MeasureTask) -> tuple[str, Any]:
        """("ok", value) or ("fault", one line); never raises for a bad candidate."""
        worker = self._ensure()
        if self.lock_path is None:
            return self._call_unlocked(worker, task)
        with GpuLock(self.lock_path):
            return self._call_unlocked(worker, task)

    def _call_unlocked(self, worker: _Worker, task: MeasureTask) -> tuple[str, Any]:
        try:
            worker.conn.send(task)
        except (OSError, BrokenPipeError):
            code = worker.process.exitcode
            self._replace()
            return "fault", _death(code)
        started = time.monotonic()
        if not worker.conn.poll(self.timeout_s):
            self._replace()
            return "fault", f"timeout after {time.monotonic() - started:.1f} s"
        try:
            status, value = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(5)
            code = worker.process.exitcode
            self._replace()
            return "fault", _death(code)
        if status == "ok":
            return "ok", value
        if status == "rejected":
            return "fault", f"rejected: {value}"
        self._replace()
        return "fault", str(value)

    def _task(self, mode: str, segment: SegmentSpace, config: Config) -> MeasureTask:
        return MeasureTask(mode=mode, family=segment.family, problem=tuple(segment.problem),  # type: ignore[arg-type]
                           config=config.key, payload=self.payload_of(segment),
                           settings=self.settings)

    def measure(self, segment: SegmentSpace, config: Config) -> Measurement:
        if self._compiler is not None:
            error = self._compiler.error(segment, config)
            if error is not None:  # never reaches the GPU worker
                return Measurement(None, f"compile error: {error}")
        status, value = self._call(self._task("time", segment, config))
        if status != "ok":
            return Measurement(None, value)
        time_ms = float(value)
        if not math.isfinite(time_ms) or time_ms <= 0:
            return Measurement(None, f"invalid time {value!r}")
        return Measurement(time_ms)

    def prepare(self, items: Sequence[tuple[SegmentSpace, Config]]) -> None:
        """Compile all ``items`` in parallel now (with a ``compiler``; else nothing to do)."""
        if self._compiler is not None:
            self._compiler.prepare(items)

    def measure_batch(self, segment: SegmentSpace, configs: list[Config]) -> list[Measurement]:
        """Compile ``configs`` in parallel (with a ``compiler``), then time each in the worker."""
        self.prepare([(segment, c) for c in configs])
        return [self.measure(segment, c) for c in configs]

    def verify(self, segment: SegmentSpace, config: Config) -> bool:
        status, value = self._call(self._task("verify", segment, config))
        return status == "ok" and bool(value)

    def close(self) -> None:
        """Stop the worker and the compile pool (idempotent)."""
        if self._compiler is not None:
            self._compiler.close()
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    def __enter__(self) -> WorkerMeasurer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
