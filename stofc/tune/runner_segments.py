"""GPU runner of the non-attention families (GEMM+epilogue, vendor cuBLAS, GEMM+Norm,
GEMM+GEMM, Add+Norm), through :class:`stofc.runtime.segments.SegmentRunner`.

Called in the measurement worker (:mod:`stofc.tune.measure`) with a
:class:`~stofc.tune.spaces.SegmentPayload`. Per worker process it keeps one
runner per layer (random weights rounded to the dtype, uploaded once) and the
input sets of the last few problems, so candidates of one segment share them.

* ``time``: the candidate's kernel spec replaces the segment's
  (:meth:`~stofc.tune.spaces.SegmentPayload.candidate_spec`), is compiled (NVRTC cache: the compile
  pool usually did it) and loaded by the runtime's own ``_compile``; one
  eager launch checks it runs; then one CUDA graph per input set is captured
  (so host overhead is not timed: the package runs segments in graphs too)
  and :func:`~stofc.tune.measure.time_with_events` times graph launches over
  the sets, which are enough to cover twice the L2
  (:func:`~stofc.tune.measure.rotation_count`; the weights stay shared, as in
  one layer of a model). If capture fails the launches are timed eagerly.
* ``verify``: outputs poisoned with NaN, one launch; every stored value must
  be finite in every row and match the float64 reference of the segment's
  ONNX operators (:func:`stofc.plan.reference.reference_ops`) on 256 random rows within
  ``2 r u + sqrt(K) 2^-22`` (``r`` operators, ``u`` the dtype's unit
  roundoff; the bound of ``tests/gpu/downstream_cases.py``).

:func:`compile_segment` renders and compiles a candidate without a GPU, through
the same ``SegmentRunner._compile`` in ``compile_only`` mode, so the worker later
finds the exact cubins in the cache.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from stofc.frontend.types import Layer, OpKind
from stofc.kernels import catalog
from stofc.plan.plan import LayerPlan, Segment
from stofc.plan.reference import reference_ops
from stofc.plan.scheme import FusionScheme
from stofc.plan.synthetic import random_weights
from stofc.runtime.module import _cupy
from stofc.runtime.segment_cublas import LtRankUnavailable
from stofc.runtime.segments import SegmentRunner, from_bits, to_bits, to_host
from stofc.tune.interfaces import Config
from stofc.tune.measure import CandidateRejected, MeasureTask, rotation_count, time_with_events
from stofc.tune.spaces import SegmentPayload

UNIT = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
CHECK_ROWS = 256
KEEP_INPUTS = 3           # problems whose input sets stay on the GPU

_RUNNERS: dict[tuple, tuple[Any, dict[str, np.ndarray]]] = {}
_INPUTS: OrderedDict[tuple, _Inputs] = OrderedDict()
_STREAM: list[Any] = []


@dataclass
class _Inputs:
    names: dict[str, tuple[int, int]]      # activation name -> shape
    sets: list[dict[str, Any]]             # per set: name -> device array


def candidate_segment(payload: SegmentPayload, config: Config) -> Segment:
    """The payload's segment with ``config``'s kernel spec."""
    return dataclasses.replace(payload.segment, kernel=payload.candidate_spec(config))


def _rounded_weights(layer: Layer, dtype: str) -> dict[str, np.ndarray]:
    raw = random_weights(layer, np.random.default_rng(0))
    return {k: from_bits(to_bits(v, dtype), dtype) for k, v in raw.items()}


def _runner(payload: SegmentPayload) -> tuple[Any, dict[str, np.ndarray]]:
    key = (payload.layer, payload.dtype, payload.arch)
    if key not in _RUNNERS:
        _RUNNERS.clear()                   # one layer's weights on the GPU at a time
        layer = payload.layer
        weights = _rounded_weights(layer, payload.dtype)
        empty = LayerPlan(layer.index, layer.norm_order, FusionScheme.unfused(len(layer.chain)),
                          ())
        runner = SegmentRunner(layer, empty, weights, dtype=payload.dtype, arch=payload.arch)
        runner.lt_exact_rank = True        # a rank the heuristic lacks is rejected, not timed
        _RUNNERS[key] = (runner, weights)
    return _RUNNERS[key]


def activation_shapes(seg: Segment, tokens: int) -> dict[str, tuple[int, int]]:
    """The segment's activation inputs (``x``, ``residual``) and their ``[tokens, width]``."""
    width_x, width_out = catalog.segment_kind(seg.family).widths(seg)
    shapes = {}
    for slot, width in (("x", width_x), ("residual", width_out)):
        name = seg.binding(slot)
        if name is not None:
            shapes[name] = (tokens, width)
    return shapes


def _output_bytes(seg: Segment, tokens: int) -> int:
    ep = seg.epilogues[-1]
    _, width = catalog.segment_kind(seg.family).widths(seg)
    return 2 * tokens * width * (2 if ep.store_pre_norm else 1)


def _random(cupy: Any, rng: Any, shape: tuple[int, int], dtype: str) -> Any:
    x = rng.standard_normal(shape, dtype=cupy.float32)
    if dtype == "float16":
        return x.astype(cupy.float16)
    u = x.view(cupy.uint32)                 # bf16 bits, round to nearest even
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cupy.uint16)


def _inputs(task: MeasureTask, payload: SegmentPayload) -> _Inputs:
    cupy = _cupy()
    key = (task.family, task.problem)
    if key in _INPUTS:
        _INPUTS.move_to_end(key)
        return _INPUTS[key]
    while len(_INPUTS) >= KEEP_INPUTS:
        _INPUTS.popitem(last=False)
        cupy.get_default_memory_pool().free_all_blocks()
    tokens = payload.batch * payload.seq_len
    names = activation_shapes(payload.segment, tokens)
    per_set = sum(2 * a * b for a, b in names.values()) + _output_bytes(payload.segment, tokens)
    count = rotation_count(per_set, payload.l2_bytes)
    rng = cupy.random.default_rng(zlib.crc32(repr(key).encode()))
    sets = [{name: _random(cupy, rng, shape, payload.dtype) for name, shape in names.items()}
            for _ in range(count)]
    _INPUTS[key] = _Inputs(names, sets)
    return _INPUTS[key]


def _prepare(task: MeasureTask) -> tuple[Any, Segment, _Inputs, SegmentPayload]:
    payload: SegmentPayload = task.payload
    runner, _ = _runner(payload)
    seg = candidate_segment(payload, task.params)
    runner.kernels[seg.ordinal] = runner._compile(seg)
    return runner, seg, _inputs(task, payload), payload


def run(task: MeasureTask) -> float | bool:
    """The runner entry for one non-attention candidate (see the module doc).

    A cuBLASLt rank (``lt_algo``) the heuristic does not return for this shape
    is rejected (:class:`~stofc.tune.measure.CandidateRejected`): it would only
    repeat the last candidate returned.
    """
    try:
        return _run(task)
    except LtRankUnavailable as err:
        raise CandidateRejected(err.message) from None


def _run(task: MeasureTask) -> float | bool:
    cupy = _cupy()
    runner, seg, inputs, p = _prepare(task)
    if task.mode == "verify":
        return verify(runner, seg, inputs, p)
    kwargs = {"batch": p.batch, "seq_len": p.seq_len}
    runner.run_segment(seg, dict(inputs.sets[0]), **kwargs)   # it runs at all
    cupy.cuda.Device().synchronize()
    stream = _capture_stream()
    graphs, keep = [], []
    try:
        for values in inputs.sets:
            vals = dict(values)
            with stream:
                stream.begin_capture()
                try:
                    runner.run_segment(seg, vals, stream=stream, **kwargs)
                finally:
                    graph = stream.end_capture()
            graphs.append(graph)
            keep.append(vals)
    except Exception:          # not capturable here: time eager launches instead
        graphs = []
    with stream:
        if graphs:
            ms = time_with_events(lambda i: graphs[i].launch(stream), len(graphs), task.settings)
        else:
            ms = time_with_events(
                lambda i: runner.run_segment(seg, dict(inputs.sets[i]), stream=stream, **kwargs),
                len(inputs.sets), task.settings)
    cupy.cuda.Device().synchronize()
    del keep
    return ms


def _capture_stream() -> Any:
    """One non-blocking stream per worker: its memory-pool arena is reused by every candidate
    (a new stream per candidate would strand each one's freed output blocks in its own arena)."""
    cupy = _cupy()
    if not _STREAM:
        _STREAM.append(cupy.cuda.Stream(non_blocking=True))
    return _STREAM[0]


def _all_finite(cupy: Any, array: Any, dtype: str) -> bool:
    if dtype == "float16":
        return bool(cupy.isfinite(array).all())
    return bool(((array & 0x7F80) != 0x7F80).all())    # bf16 bits: exponent not all ones


def segment_reference(layer: Layer, seg: Segment, values: dict[str, np.ndarray],
                      weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Float64 values of the segment's operators (ONNX semantics) from its inputs."""
    env = {k: np.asarray(v, np.float64) for k, v in values.items()}
    return reference_ops(layer, seg.ops, env, weights)


def error_bound(layer: Layer, seg: Segment, dtype: str) -> float:
    """``2 r u + sqrt(K) 2^-22`` with ``r`` the segment's operators (module doc)."""
    ks = [int(layer.chain[i].param("in_features")) for i in seg.ops
          if layer.chain[i].kind == OpKind.GEMM] or [1]
    return 2 * len(seg.ops) * UNIT[dtype] + math.sqrt(max(ks)) * 2.0**-22


def verify(runner: Any, seg: Segment, inputs: _Inputs, p: SegmentPayload) -> bool:
    """Poisoned outputs, one launch, the float64 check on random rows (module doc)."""
    cupy = _cupy()
    _, weights = _runner(p)
    tokens = p.batch * p.seq_len
    values = dict(inputs.sets[0])
    runner.poison = True
    try:
        runner.run_segment(seg, values, batch=p.batch, seq_len=p.seq_len)
        cupy.cuda.Device().synchronize()
    finally:
        runner.poison = False
    rng = np.random.default_rng(tokens)
    rows = np.sort(rng.choice(tokens, min(tokens, CHECK_ROWS), replace=False))
    rows_dev = cupy.asarray(rows)
    host = {name: to_host(values[name][rows_dev], p.dtype) for name in inputs.names}
    want = segment_reference(p.layer, seg, host, weights)
    bound = error_bound(p.layer, seg, p.dtype)
    for name in seg.outputs:
        dev = values[name]
        if not _all_finite(cupy, dev, p.dtype):
            return False                       # unwritten (poisoned) or non-finite rows
        if dev.ndim == 5:                      # [G, B, H, S, D] -> [B*S, G*H*D]
            dev = dev.transpose(1, 3, 0, 2, 4).reshape(tokens, -1)
        got = to_host(dev[rows_dev], p.dtype).astype(np.float64)
        diff = float(np.linalg.norm(got - want[name])) / max(float(np.linalg.norm(want[name])),
                                                             1e-30)
        if not diff <= bound:
            return False
    return True


def compile_segment(payload: SegmentPayload, config_key: str) -> None:
    """Compile a candidate's kernels into the on-disk cache (no GPU needed): the runner's
    own compile path with nothing loaded (``compile_only``), so the worker later finds
    the exact cubins in the cache."""
    seg = candidate_segment(payload, Config.from_key(config_key))
    layer = payload.layer
    empty = LayerPlan(layer.index, layer.norm_order, FusionScheme.unfused(len(layer.chain)), ())
    SegmentRunner(layer, empty, {}, dtype=payload.dtype, arch=payload.arch,
                  compile_only=True)._compile(seg)
