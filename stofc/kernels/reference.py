"""Float64 numpy references of the ONNX operators the downstream families replace.

MatMul (+ Add bias), Gelu (erf and tanh forms, ONNX ``approximation``), Relu, SiLU,
a gated FFN's ``act(gate) * up``, the rotary position embedding (:func:`rope`),
Add (residual), LayerNormalization (axis -1) and RMSNormalization (axis -1,
``x / sqrt(mean(x^2) + eps) * scale``), and a fused epilogue made of them. Whole
chains and segments are evaluated by :mod:`stofc.plan.reference`; GPU tests compare
every fused kernel against these.
"""

from __future__ import annotations

import math

import numpy as np

from stofc.kernels.epilogue import Epilogue

_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu(x: np.ndarray, approximation: str = "none") -> np.ndarray:
    """ONNX Gelu: exact ``0.5x(1+erf(x/sqrt2))`` or the tanh approximation."""
    x = np.asarray(x, dtype=np.float64)
    if approximation == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def activate(x: np.ndarray, act: str) -> np.ndarray:
    """Epilogue activation codes (see :mod:`stofc.kernels.epilogue`)."""
    if act == "gelu_erf":
        return gelu(x, "none")
    if act == "gelu_tanh":
        return gelu(x, "tanh")
    if act == "relu":
        return np.maximum(x, 0.0)
    if act == "silu":
        x = np.asarray(x, dtype=np.float64)
        return x / (1.0 + np.exp(-x))
    return x


def gated(y: np.ndarray, act: str) -> np.ndarray:
    """A gated FFN's ``act(gate) * up`` on ``y = [gate | up]`` (last axis), in float64."""
    y = np.asarray(y, dtype=np.float64)
    half = y.shape[-1] // 2
    return activate(y[..., :half], act) * y[..., half:]


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary_dim: int,
         interleaved: bool) -> np.ndarray:
    """RoPE of ``x [..., D]`` in float64: the first ``rotary_dim`` elements of the last axis
    rotated, the rest kept.

    ``cos`` / ``sin`` broadcast against ``x[..., :rotary_dim]`` with a last axis of
    ``rotary_dim`` (full tables: element ``i`` uses ``cos[..., i]``) or ``rotary_dim / 2``
    (half tables: pair ``j`` uses ``cos[..., j]``; the pairs are ``(j, j + rotary_dim/2)``
    rotate-half, ``(2j, 2j + 1)`` interleaved). With ``r`` the rotation of the part
    (rotate-half: ``[-x2, x1]`` of its halves; interleaved: ``(x0, x1) -> (-x1, x0)`` per
    adjacent pair) the result is ``part * cos + r * sin``: the arithmetic of Llama's
    ``rotate_half`` and GPT-J's interleaved form, ONNX's and ONNX Runtime's
    ``RotaryEmbedding``.
    """
    x = np.asarray(x, dtype=np.float64)
    rd = int(rotary_dim)
    c, s = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    if rd <= 0 or rd % 2 or rd > x.shape[-1]:
        raise ValueError(f"rotary_dim {rd} is not even and within the head dimension "
                         f"{x.shape[-1]}")
    if c.shape[-1] != rd:
        if c.shape[-1] != rd // 2:
            raise ValueError(f"cos/sin have {c.shape[-1]} columns; rotary_dim {rd} takes "
                             f"{rd} or {rd // 2}")
        c, s = ((np.repeat(t, 2, axis=-1) if interleaved else np.concatenate([t, t], axis=-1))
                for t in (c, s))
    part = x[..., :rd]
    if interleaved:
        rot = np.stack([-part[..., 1::2], part[..., 0::2]], axis=-1).reshape(part.shape)
    else:
        rot = np.concatenate([-part[..., rd // 2:], part[..., :rd // 2]], axis=-1)
    out = x.copy()
    out[..., :rd] = part * c + rot * s
    return out


def layernorm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray | None,
              eps: float) -> np.ndarray:
    """ONNX LayerNormalization over the last axis (population variance)."""
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps) * np.asarray(gamma, np.float64)
    return y + np.asarray(beta, np.float64) if beta is not None else y


def rmsnorm(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * gamma``."""
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * np.asarray(gamma, np.float64)


def apply_epilogue(y: np.ndarray, ep: Epilogue, *, bias=None, residual=None, gamma=None,
                   beta=None, eps: float = 1e-5) -> tuple[np.ndarray, np.ndarray | None]:
    """``(out, pre_norm)``: bias -> activation -> residual -> norm, in float64."""
    v = np.asarray(y, dtype=np.float64)
    if ep.bias:
        v = v + np.asarray(bias, np.float64)
    v = activate(v, ep.act)
    if ep.residual:
        v = v + np.asarray(residual, np.float64)
    if ep.norm == "layernorm":
        return layernorm(v, gamma, beta if ep.norm_shift else None, eps), v
    if ep.norm == "rmsnorm":
        return rmsnorm(v, gamma, eps), v
    return v, None


def gemm(x: np.ndarray, w_kn: np.ndarray, ep: Epilogue, **epilogue_inputs
         ) -> tuple[np.ndarray, np.ndarray | None]:
    """``epilogue(x @ W)`` with W in MatMul layout [K, N], in float64."""
    y = np.asarray(x, np.float64) @ np.asarray(w_kn, np.float64)
    return apply_epilogue(y, ep, **epilogue_inputs)


def attention_dense(qkv: np.ndarray, batch: int, heads: int, scale: float) -> np.ndarray:
    """Dense softmax attention on a packed ``[B*S, 3*H*D]`` projection (float64)."""
    qkv = np.asarray(qkv, np.float64)
    tokens, width = qkv.shape
    seq, dim = tokens // batch, width // (3 * heads)
    q, k, v = (qkv.reshape(batch, seq, 3, heads, dim)[:, :, i].transpose(0, 2, 1, 3)
               for i in range(3))
    s = q @ k.transpose(0, 1, 3, 2) * scale
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return (p @ v).transpose(0, 2, 1, 3).reshape(tokens, heads * dim)
