"""Parallel compilation of candidates, beside the GPU worker (compiling needs no GPU).

A :class:`CompilePool` runs ``compiler(payload, config_key)`` (a module-level
function named ``"module:function"``; e.g. render and
:func:`stofc.compile.nvrtc.compile_source` into the on-disk kernel cache, so
the GPU worker's runner later loads the cubin at once) for many candidates
at a time in ``workers`` spawned processes. Each (segment, config) is
compiled at most once; its error, if any, is kept as one line.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import importlib
import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

from stofc.tune.interfaces import Config, SegmentSpace, segment_key

Key = tuple[tuple[str, str, str], str]


def _compile_one(ref: str, payload: Any, config_key: str) -> None:
    """In a pool process: ``function(payload, config_key)`` of ``ref``."""
    module_name, _, attr = ref.partition(":")
    getattr(importlib.import_module(module_name), attr)(payload, config_key)


def one_line(err: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


class CompilePool:
    """Compiles (segment, config) pairs in parallel, each once (see the module doc)."""

    def __init__(self, compiler: str, workers: int,
                 payload_of: Callable[[SegmentSpace], Any]) -> None:
        self.compiler = compiler
        self.workers = workers
        self.payload_of = payload_of
        self.done: dict[Key, str | None] = {}   # key -> error (None: compiled)
        self.submitted = 0
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def prepare(self, items: Sequence[tuple[SegmentSpace, Config]]) -> None:
        """Compile every pair not compiled yet, all at once; wait for them."""
        todo: dict[Key, tuple[SegmentSpace, Config]] = {}
        for segment, config in items:
            key = (segment_key(segment), config.key)
            if key not in self.done:
                todo[key] = (segment, config)
        if not todo:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"))
        futures = {key: self._pool.submit(_compile_one, self.compiler, self.payload_of(seg),
                                          config.key)
                   for key, (seg, config) in todo.items()}
        self.submitted += len(futures)
        broken = False
        for key, future in futures.items():
            try:
                future.result()
                self.done[key] = None
            except concurrent.futures.process.BrokenProcessPool:
                self.done[key] = "compiler process died"
                broken = True
            except Exception as err:
                self.done[key] = one_line(err)
        if broken:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def error(self, segment: SegmentSpace, config: Config) -> str | None:
        """The compile error of a pair (compiling it now if it never was), or None."""
        key = (segment_key(segment), config.key)
        if key not in self.done:
            self.prepare([(segment, config)])
        return self.done[key]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
