"""GPU runner of the attention segment, through :class:`stofc.runtime.attention.AttentionOp`.

Called in the measurement worker with an
:class:`~stofc.tune.spaces.AttentionPayload`; the config names the kernel
(``block`` / ``row``) and its shape (:class:`~stofc.kernels.attention.AttentionConfig`).

* Inputs: random packed projections, ``[B, S, 3, H, D]`` (the ``row`` QKV
  store; Q/K/V read in place as ``bshd`` slices) or ``[3, B, H, S, D]``
  (``heads`` store, ``bhsd``), in the dtype, enough sets to cover twice the L2
  (:func:`~stofc.tune.measure.rotation_count`), kept for the last few problems.
* The kernel variant is the one the package deploys: with a key padding mask
  (``payload.key_bits``, an all-ones ``[B, S]`` mask) when the layer's
  SparseAttention receives one, an additive bias (``payload.bias``: a random
  ``[1, H, S, S]`` in the dtype, one per problem) when it adds one, soft-capped
  scores (``payload.softcap``: at :data:`SOFTCAP`) when it caps them. A bias costs
  its own loads and registers (four ws consumer warpgroups spill with one and run
  17-22% slower than three), so a bias layer's configs are ranked with it.
* ``time``: a config :func:`~stofc.kernels.attention.prune` rejects is a
  :class:`~stofc.tune.measure.CandidateRejected`; otherwise one
  :class:`~stofc.runtime.module.BoundLaunch` per input set (one driver call
  per launch, so host overhead is negligible) timed with
  :func:`~stofc.tune.measure.time_with_events`.
* ``verify``: output poisoned with NaN, one launch; the whole output must be
  finite, and sampled (batch, head) pairs must match
  :func:`~stofc.kernels.attention.reference_attention` (float64, the mask
  decoded independently by ``dense_from_format``, with the same bias and cap)
  within the GPU tests' tolerance (relative Frobenius 2e-3 fp16, 1e-2 bf16).

:func:`compile_attention` compiles a candidate into the NVRTC cache without a GPU.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from typing import Any

import numpy as np

from stofc.kernels import catalog
from stofc.kernels.attention.config import AttentionConfig, KernelSpec, prune
from stofc.kernels.attention.reference import dense_from_format, reference_attention
from stofc.kernels.attention.render import compile_kernel
from stofc.runtime.attention import AttentionOp
from stofc.runtime.module import _cupy
from stofc.runtime.segments import to_host
from stofc.targets import detect
from stofc.tune.interfaces import Config
from stofc.tune.measure import CandidateRejected, MeasureTask, rotation_count, time_with_events
from stofc.tune.spaces import AttentionPayload

TOL = {"float16": 2e-3, "bfloat16": 1e-2}
SOFTCAP = 50.0                  # Gemma 2's attention cap (the kernel's cost does not depend on it)
KEEP_INPUTS = 2
KEEP_OPS = 8

_INPUTS: OrderedDict[tuple, list[tuple[Any, Any, Any, Any]]] = OrderedDict()
_OPS: OrderedDict[tuple, Any] = OrderedDict()
_DENSE: dict[str, np.ndarray] = {}
_BIAS: OrderedDict[tuple, Any] = OrderedDict()


def attention_config(params: Any) -> AttentionConfig:
    """The AttentionConfig of a tuner config (through the family it belongs to)."""
    return catalog.family_of_params("attention", params).from_params(params)


def _profile() -> Any:
    return detect()


def _op(p: AttentionPayload, config: Any) -> Any:
    key = (p.fmt.spec_hash, config, p.dtype, p.head_dim)
    if key not in _OPS:
        while len(_OPS) >= KEEP_OPS:
            _OPS.popitem(last=False)
        _OPS[key] = AttentionOp(p.fmt, config, p.dtype, p.head_dim, _profile())
    return _OPS[key]


def _random(cupy: Any, rng: Any, shape: tuple[int, ...], dtype: str) -> Any:
    x = rng.standard_normal(shape, dtype=cupy.float32)
    if dtype == "float16":
        return x.astype(cupy.float16)
    u = x.view(cupy.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cupy.uint16)


def _inputs(task: MeasureTask, p: AttentionPayload) -> list[tuple[Any, Any, Any, Any]]:
    """Input sets ``(q, k, v, out)`` as views of packed projections (module doc)."""
    cupy = _cupy()
    key = (task.family, task.problem)
    if key in _INPUTS:
        _INPUTS.move_to_end(key)
        return _INPUTS[key]
    while len(_INPUTS) >= KEEP_INPUTS:
        _INPUTS.popitem(last=False)
        cupy.get_default_memory_pool().free_all_blocks()
    b, s, h, d = p.batch, p.seq_len, p.heads, p.head_dim
    per_set = 2 * b * s * h * d * 4                      # Q, K, V and the output
    count = rotation_count(per_set, p.l2_bytes)
    rng = cupy.random.default_rng(zlib.crc32(repr(key).encode()))
    sets = []
    storage = cupy.float16 if p.dtype == "float16" else cupy.uint16
    for _ in range(count):
        if p.layout == "bshd":
            qkv = _random(cupy, rng, (b, s, 3, h, d), p.dtype)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            out = cupy.empty((b, s, h, d), dtype=storage)
        else:
            qkv = _random(cupy, rng, (3, b, h, s, d), p.dtype)
            q, k, v = qkv[0], qkv[1], qkv[2]
            out = cupy.empty((b, h, s, d), dtype=storage)
        sets.append((q, k, v, out))
    _INPUTS[key] = sets
    return sets


def run(task: MeasureTask) -> float | bool:
    """The runner entry for one attention candidate (see the module doc)."""
    cupy = _cupy()
    p: AttentionPayload = task.payload
    config = attention_config(task.params)
    reason = prune(config, p.head_dim, _profile())
    if reason:
        raise CandidateRejected(reason)
    if config.tile != p.fmt.tile:
        raise CandidateRejected(f"kernel tile {config.tile} != mask tile {p.fmt.tile}")
    op = _op(p, config)
    sets = _inputs(task, p)
    extra = _extra_inputs(task, p)
    if task.mode == "verify":
        return verify(op, sets[0], p, extra)
    bound = [op.bind(q, k, v, out, layout=p.layout, scale=p.scale, **extra)
             for q, k, v, out in sets]
    bound[0].launch()
    cupy.cuda.Device().synchronize()
    ms = time_with_events(lambda i: bound[i].launch(), len(bound), task.settings)
    cupy.cuda.Device().synchronize()
    return ms


def _key_mask(p: AttentionPayload) -> Any:
    """An all-real-token ``[B, S]`` key mask when the deployed kernel tests key bits."""
    if not getattr(p, "key_bits", False):
        return None
    cupy = _cupy()
    return cupy.ones((p.batch, p.seq_len), dtype=cupy.int32)


def _extra_inputs(task: MeasureTask, p: AttentionPayload) -> dict[str, Any]:
    """The node's inputs besides Q, K and V as ``bind`` takes them: the key mask, the bias
    (random ``[1, H, S, S]`` in the dtype, made once per problem) and the cap."""
    bias = None
    if getattr(p, "bias", False):
        key = (task.family, task.problem)
        if key not in _BIAS:
            while len(_BIAS) >= KEEP_INPUTS:
                _BIAS.popitem(last=False)
            cupy = _cupy()
            rng = cupy.random.default_rng(zlib.crc32(repr(("bias", *key)).encode()))
            _BIAS[key] = _random(cupy, rng, (1, p.heads, p.seq_len, p.seq_len), p.dtype)
        bias = _BIAS[key]
    return {"key_mask": _key_mask(p), "bias": bias,
            "softcap": SOFTCAP if getattr(p, "softcap", False) else 0.0}


def _head(x: Any, layout: str, b: int, h: int) -> Any:
    return x[b, :, h, :] if layout == "bshd" else x[b, h]


def verify(op: Any, inputs: tuple[Any, Any, Any, Any], p: AttentionPayload,
           extra: dict[str, Any]) -> bool:
    """Poisoned output, one launch, the float64 check on sampled (batch, head) pairs
    (``extra``: the node's other inputs, :func:`_extra_inputs`)."""
    cupy = _cupy()
    q, k, v, out = inputs
    nan = np.float16(np.nan) if p.dtype == "float16" else np.uint16(0x7FC0)
    out.fill(nan)
    op.run(q, k, v, out, layout=p.layout, scale=p.scale, **extra)
    cupy.cuda.Device().synchronize()
    if p.dtype == "float16":
        finite = bool(cupy.isfinite(out).all())
    else:
        finite = bool(((out & 0x7F80) != 0x7F80).all())
    if not finite:
        return False
    if p.fmt.spec_hash not in _DENSE:
        _DENSE[p.fmt.spec_hash] = dense_from_format(p.fmt)
    dense = _DENSE[p.fmt.spec_hash]
    rng = np.random.default_rng(p.batch * p.heads)
    pairs = {(0, 0), (p.batch - 1, p.heads - 1),
             (int(rng.integers(p.batch)), int(rng.integers(p.heads)))}
    num = den = 0.0
    for b, h in sorted(pairs):
        qh, kh, vh = (to_host(cupy.ascontiguousarray(_head(x, p.layout, b, h)), p.dtype)
                      for x in (q, k, v))
        mask = dense[0 if dense.shape[0] == 1 else h]
        bias = extra["bias"]
        bh = None if bias is None else to_host(cupy.ascontiguousarray(bias[:, h:h + 1]), p.dtype)
        want = reference_attention(qh[None, :, None, :], kh[None, :, None, :],
                                   vh[None, :, None, :], mask, p.scale, bias=bh,
                                   softcap=extra["softcap"])[0, :, 0, :]
        got = to_host(cupy.ascontiguousarray(_head(out, p.layout, b, h)), p.dtype)
        num += float(np.sum((got.astype(np.float64) - want) ** 2))
        den += float(np.sum(want**2))
    return bool(np.sqrt(num) <= TOL[p.dtype] * max(np.sqrt(den), 1e-30))


def compile_attention(payload: AttentionPayload, config_key: str) -> None:
    """Compile a candidate into the NVRTC cache (no GPU), as ``AttentionOp`` will load it."""
    config = attention_config(Config.from_key(config_key))
    compile_kernel(KernelSpec(config, payload.dtype, payload.head_dim,
                              bool(getattr(payload, "bias", False)),
                              bool(getattr(payload, "key_bits", False)),
                              bool(getattr(payload, "softcap", False))), payload.arch)
