"""Measurement isolation on CPU: faults, aborts and timeouts in the worker never leak."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from stofc.tune.interfaces import Config
from stofc.tune.measure import MeasureTask, WorkerMeasurer, rotation_count

RUNNER = "tests.tune_simulate:run_simulated_task"


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STOFC_CACHE_DIR", str(tmp_path / "cache"))


@dataclass(frozen=True)
class FakeSegment:
    family: str = "fake"
    problem: tuple = (128, 64)
    compile_options: tuple = ()
    label: str = "fake segment"
    payload: dict = field(default_factory=dict, hash=False, compare=False)


def cfg(n: int) -> Config:
    return Config.of(block=n)


def segment(**behaviour: str) -> FakeSegment:
    return FakeSegment(payload={"base_ms": 1.0,
                                "behaviour": {cfg(int(k[1:])).key: v for k, v in behaviour.items()}})


def expected_ms(config: Config) -> float:
    from tests.tune_simulate import run_simulated_task
    task = MeasureTask("time", "fake", (128, 64), config.key, {"base_ms": 1.0, "behaviour": {}})
    return run_simulated_task(task)


def test_faults_are_recorded_and_never_poison_later_measurements():
    seg = segment(c2="raise", c3="abort", c4="sleep", c5="exit", c6="reject")
    with WorkerMeasurer(RUNNER, timeout_s=1.5, start_timeout_s=60) as measurer:
        assert (measurer.gpu, measurer.driver) == ("SIM GPU", "0.0")
        good = measurer.measure(seg, cfg(1))
        assert good.ok and math.isclose(good.time_ms, expected_ms(cfg(1)))

        sticky = measurer.measure(seg, cfg(2))
        assert sticky.fault is not None and "IllegalAddress" in sticky.fault
        # The sticky error poisoned that worker; the next candidate runs in a fresh one.
        assert measurer.measure(seg, cfg(1)).time_ms == good.time_ms

        aborted = measurer.measure(seg, cfg(3))
        assert aborted.fault == "worker died (SIGABRT)"
        assert measurer.measure(seg, cfg(1)).time_ms == good.time_ms

        hung = measurer.measure(seg, cfg(4))
        assert hung.fault is not None and hung.fault.startswith("timeout after 1.")
        assert measurer.measure(seg, cfg(1)).time_ms == good.time_ms

        exited = measurer.measure(seg, cfg(5))
        assert exited.fault == "worker died (exit code 3)"

        replaced = measurer.replacements
        rejected = measurer.measure(seg, cfg(6))
        assert rejected.fault == "rejected: needs 300 KiB shared memory"
        assert measurer.replacements == replaced  # a clean rejection keeps the worker
        assert measurer.measure(seg, cfg(7)).time_ms == pytest.approx(expected_ms(cfg(7)))

        assert measurer.replacements == 4
        assert len(set(measurer.worker_pids)) == 5


def test_verify_runs_in_the_worker():
    seg = segment(c2="wrong", c3="abort")
    with WorkerMeasurer(RUNNER, timeout_s=5, start_timeout_s=60) as measurer:
        assert measurer.verify(seg, cfg(1)) is True
        assert measurer.verify(seg, cfg(2)) is False
        assert measurer.verify(seg, cfg(3)) is False   # a crash is never "correct"
        assert measurer.verify(seg, cfg(1)) is True


def test_a_runner_that_cannot_load_is_a_clear_error():
    from stofc.tune.measure import WorkerUnavailable
    measurer = WorkerMeasurer("stofc.tune.no_such_module:run", start_timeout_s=60)
    with pytest.raises(WorkerUnavailable, match="ModuleNotFoundError") as err:
        measurer.measure(segment(), cfg(1))
    assert err.value.exit_code == 2 and "\n" not in str(err.value)


def test_rotation_exceeds_l2():
    l2 = 50 * 1024 * 1024
    n = rotation_count(8 * 1024 * 1024, l2)
    assert n * 8 * 1024 * 1024 >= 2 * l2
    assert rotation_count(1 << 40, l2) == 2
    assert rotation_count(1, l2) == 64


def test_batches_compile_in_parallel_beside_the_worker_and_compile_errors_are_faults():
    from stofc.tune.evaluate import Evaluator

    seg = FakeSegment(payload={"base_ms": 1.0, "behaviour": {cfg(4).key: "abort"},
                               "compile_errors": [cfg(2).key]})
    with WorkerMeasurer(RUNNER, timeout_s=5, start_timeout_s=60, compile_workers=2,
                        compiler="tests.tune_simulate:compile_simulated") as measurer:
        evaluator = Evaluator(measurer)
        results = evaluator.measure_many(seg, [cfg(1), cfg(2), cfg(3), cfg(1), cfg(4), cfg(5)])
        assert [r.ok for r in results] == [True, False, True, True, False, True]
        assert results[1].fault.startswith("compile error: RuntimeError: NVRTC: too many")
        assert results[4].fault == "worker died (SIGABRT)"
        assert results[5].time_ms == pytest.approx(expected_ms(cfg(5)))
        assert measurer.replacements == 1  # only the abort; compile errors never touch the GPU worker
        assert evaluator.stats.measured == 5 and evaluator.stats.memo_hits == 1


def test_the_gpu_probe_kernel_compiles_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("STOFC_CACHE_DIR", str(tmp_path))
    from stofc.compile import compile_source
    from stofc.tune.probe import PROBE_SOURCE

    for target in ("sm_80", "sm_90"):
        assert compile_source(PROBE_SOURCE, target).binary[:4] == b"\x7fELF"


def _measure_many_times(log: str, lock: str, count: int) -> None:
    seg = FakeSegment(payload={"base_ms": 1.0, "behaviour": {}, "log": log, "hold_s": 0.03})
    with WorkerMeasurer(RUNNER, timeout_s=10, start_timeout_s=60, lock_path=Path(lock)) as m:
        for i in range(count):
            assert m.measure(seg, cfg(i)).ok


def test_two_tuners_on_one_machine_never_time_at_the_same_moment(tmp_path):
    import multiprocessing

    log, lock = tmp_path / "log.txt", tmp_path / "measure.lock"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_measure_many_times, args=(str(log), str(lock), 8))
             for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    spans = sorted(tuple(map(float, line.split()[1:])) for line in log.read_text().splitlines())
    assert len(spans) == 16
    assert len({line.split()[0] for line in log.read_text().splitlines()}) == 2
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end - 1e-3


def test_time_with_events_warms_up_rotates_inputs_and_takes_the_median(monkeypatch):
    """The CUDA-event loop against a fake CuPy whose clock each launch advances."""
    import sys
    import types

    from stofc.tune.measure import TimingSettings, time_with_events

    clock = {"now": 0.0}
    syncs: list[str] = []

    class Event:
        def record(self):
            self.at = clock["now"]

        def synchronize(self):
            syncs.append("event")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Event=Event,
        Device=lambda: types.SimpleNamespace(synchronize=lambda: syncs.append("device")),
        get_elapsed_time=lambda start, end: end.at - start.at))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    launched: list[int] = []
    durations = [5.0, 1.0, 2.0, 9.0, 3.0]  # ms per launch, by call number after warm-up

    def launch(i: int) -> None:
        n = len(launched)
        launched.append(i)
        clock["now"] += 100.0 if n < 2 else durations[(n - 2) % len(durations)]

    ms = time_with_events(launch, 3, TimingSettings(warmup=2, repeats=5, inner=1))
    assert launched == [0, 1, 2, 0, 1, 2, 0]          # rotation over the 3 input sets
    assert ms == 3.0                                   # median of 5, 1, 2, 9, 3; warm-up excluded
    assert syncs[0] == "device" and syncs.count("event") == 5
    launched.clear()
    ms = time_with_events(launch, 2, TimingSettings(warmup=2, repeats=2, inner=2))
    assert launched == [0, 1, 0, 1, 0, 1]
    assert ms == pytest.approx(((5.0 + 1.0) / 2 + (2.0 + 9.0) / 2) / 2)


def test_driver_release_is_read_from_proc(tmp_path):
    from stofc.tune.measure import driver_release

    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  "
                       "Release Build  (dvs-builder@U16-I3-B03-4-3)  Sun Jul 27 06:54:38 UTC 2025\n"
                       "GCC version:  gcc version 13.3.0\n")
    assert driver_release(version) == "580.65.06"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.127.05  Tue Oct\n")
    assert driver_release(version) == "550.127.05"
    assert driver_release(tmp_path / "missing") is None


def test_prefetch_compiles_across_segments_once_each_in_pool_processes(tmp_path):
    import os

    from stofc.tune.evaluate import Evaluator

    log = tmp_path / "compiles.txt"
    segs = [FakeSegment(problem=(n,), payload={"base_ms": 1.0, "behaviour": {},
                                               "compile_log": str(log)}) for n in (1, 2)]
    with WorkerMeasurer(RUNNER, timeout_s=5, start_timeout_s=60, compile_workers=2,
                        compiler="tests.tune_simulate:compile_simulated") as measurer:
        evaluator = Evaluator(measurer)
        evaluator.prefetch([(s, cfg(i)) for s in segs for i in range(6)])
        lines = log.read_text().splitlines()
        assert len(lines) == 12 and str(os.getpid()) not in {line.split()[0] for line in lines}
        for s in segs:
            assert all(m.ok for m in evaluator.measure_many(s, [cfg(i) for i in range(6)]))
        assert len(log.read_text().splitlines()) == 12   # measuring compiled nothing again
        evaluator.prefetch([(segs[0], cfg(0)), (segs[0], cfg(9))])  # known: only cfg(9) compiles
        assert log.read_text().splitlines()[-1].endswith(cfg(9).key)
        assert len(log.read_text().splitlines()) == 13
