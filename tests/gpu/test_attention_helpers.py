"""Shared machinery of the GPU attention tests: random inputs, poisoned outputs, the check."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stofc.kernels.attention.reference import (
    dense_from_format,
    from_bf16_bits,
    reference_attention,
    to_bf16_bits,
)
from stofc.masks import encode
from stofc.runtime.attention import AttentionOp
from stofc.targets import detect

TOL = {"float16": 2e-3, "bfloat16": 1e-2}


@dataclass
class Result:
    err: float
    nan: bool
    out: np.ndarray
    ref: np.ndarray


def quantise(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(device bits or fp16 array, the float64 values the kernel really sees)."""
    if dtype == "float16":
        h = x.astype(np.float16)
        return h, h.astype(np.float64)
    bits = to_bf16_bits(x)
    return bits, from_bf16_bits(bits).astype(np.float64)


def encoded(spec: str, seq_len: int, *, tile: int = 64, num_heads: int | None = None):
    fmt = encode(spec, seq_len, tile=tile, num_heads=num_heads)
    return fmt, dense_from_format(fmt)       # what the kernels must compute, decoded independently


def run_case(fmt, dense, config, *, batch: int, heads: int, seq: int, head_dim: int,
             dtype: str = "float16", seq_lens=None, key_mask=None, bias_shape=None,
             layout: str = "bshd", packed: bool = False, scale: float | None = None,
             seed: int | None = None, kv_heads: int | None = None, softcap: float = 0.0,
             score_scale: float = 1.0, profile=None) -> Result:
    """Fresh random inputs, NaN-poisoned output, one launch, compare to float64.

    ``profile``: the GPU profile the op plans for (default: this GPU's; a smaller
    ``sm_count`` makes a persistent grid walk more works per block);
    ``kv_heads`` < heads: grouped-query attention (K/V have kv_heads heads);
    ``softcap``: logit soft-capping; ``score_scale`` multiplies q (large values
    push the soft-capping tanh into saturation).
    """
    import cupy as cp

    rng = np.random.default_rng(seed)
    shape = (batch, seq, heads, head_dim)
    hk = heads if kv_heads is None else kv_heads
    if packed:                                   # [B, S, H + 2*Hkv, D] QKV projection output
        qkv_dev, qkv = quantise(rng.standard_normal((batch, seq, heads + 2 * hk, head_dim)), dtype)
        dev = cp.asarray(qkv_dev)
        q_d, k_d, v_d = dev[:, :, :heads], dev[:, :, heads:heads + hk], dev[:, :, heads + hk:]
        q, k, v = qkv[:, :, :heads], qkv[:, :, heads:heads + hk], qkv[:, :, heads + hk:]
    else:
        kv_shape = (batch, seq, hk, head_dim)
        parts = [quantise(rng.standard_normal(sh) * s, dtype)
                 for sh, s in ((shape, score_scale), (kv_shape, 1.0), (kv_shape, 1.0))]
        (q_h, q), (k_h, k), (v_h, v) = parts
        q_d, k_d, v_d = (cp.asarray(x) for x in (q_h, k_h, v_h))
        if layout == "bhsd":
            q_d, k_d, v_d = (cp.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q_d, k_d, v_d))
    bias_d = bias = None
    if bias_shape is not None:
        bias_d, bias = quantise(rng.standard_normal(bias_shape) * 2.0, dtype)
        bias_d = cp.asarray(bias_d)
    poison = np.float16(np.nan) if dtype == "float16" else np.uint16(0x7FC0)
    out_shape = (batch, heads, seq, head_dim) if layout == "bhsd" else shape
    out = cp.full(out_shape, poison, dtype=np.float16 if dtype == "float16" else np.uint16)
    op = AttentionOp(fmt, config, dtype, head_dim, profile or detect())
    op.run(q_d, k_d, v_d, out, layout=layout, scale=scale, softcap=softcap,
           seq_lens=None if seq_lens is None else cp.asarray(np.asarray(seq_lens, np.int32)),
           key_mask=None if key_mask is None else cp.asarray(np.asarray(key_mask, np.int32)),
           bias=bias_d)
    cp.cuda.runtime.deviceSynchronize()
    got = cp.asnumpy(out)
    got = got.astype(np.float64) if dtype == "float16" else from_bf16_bits(got).astype(np.float64)
    if layout == "bhsd":
        got = got.transpose(0, 2, 1, 3)
    ref = reference_attention(q, k, v, dense, scale or 1.0 / np.sqrt(head_dim),
                              seq_lens=seq_lens, key_mask=key_mask, bias=bias, softcap=softcap)
    nan = bool(np.isnan(got).any())
    denom = max(np.linalg.norm(ref), 1e-30)
    err = float(np.linalg.norm(np.nan_to_num(got, nan=1e6) - ref) / denom)
    return Result(err, nan, got, ref)
