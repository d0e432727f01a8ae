"""Float64 numpy references of the ONNX operators the downstream families replace.

MatMul (+ Add bias), Gelu (erf and tanh forms, ONNX ``approximation``), Relu,
Add (residual), LayerNormalization (axis -1) and RMSNormalization (axis -1,
``x / sqrt(mean(x^2) + eps) * scale``). :func:`reference_chain` evaluates a
layer chain operator by operator in ONNX semantics, with attention supplied
by the caller; GPU tests compare every fused kernel against these.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from stofc.frontend.types import Layer, OpKind
from stofc.kernels.epilogue import Epilogue
from stofc.plan.dataflow import resolve_dataflow

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
    return x


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


def weight_kn(layer: Layer, op_index: int, weights: dict[str, np.ndarray]) -> np.ndarray:
    """A GEMM's weight in [K, N] (MatMul) layout, whatever the model stored."""
    op = layer.chain[op_index]
    w = np.asarray(weights[op.param("weight")])
    return w if op.param("weight_layout", "KN") == "KN" else w.T


def reference_chain(layer: Layer, values: dict[str, np.ndarray], weights: dict[str, np.ndarray],
                    attention: Callable[[list[np.ndarray]], np.ndarray]) -> dict[str, np.ndarray]:
    """Evaluate ``layer.chain`` in float64; ``values`` must hold the layer input.

    Activations are 2-D ``[tokens, features]``. ``attention`` receives the
    projection results and returns the attention output. Returns every value.
    """
    env = {k: np.asarray(v, np.float64) for k, v in values.items()}
    for flow, op in zip(resolve_dataflow(layer), layer.chain, strict=True):
        ins = [env[v] for v in flow.inputs]
        if op.kind == OpKind.GEMM:
            out = ins[0] @ weight_kn(layer, op.index, weights).astype(np.float64)
        elif op.kind == OpKind.BIAS_ADD:
            out = ins[0] + weights[op.param("bias")]
        elif op.kind == OpKind.ATTENTION:
            out = np.asarray(attention(ins), np.float64)
        elif op.kind == OpKind.RESIDUAL_ADD:
            out = ins[0] + ins[1]
        elif op.kind == OpKind.GELU:
            tanh = op.param("approximation") == "tanh" or op.param("form") in ("tanh", "fastgelu")
            out = gelu(ins[0], "tanh" if tanh else "none")
        elif op.kind == OpKind.ACTIVATION:
            out = np.maximum(ins[0], 0.0)
        elif op.kind == OpKind.LAYERNORM:
            beta = op.param("bias")
            out = layernorm(ins[0], weights[op.param("scale")],
                            weights[beta] if beta is not None else None,
                            float(op.param("epsilon", 1e-5)))
        else:
            out = rmsnorm(ins[0], weights[op.param("scale")], float(op.param("epsilon", 1e-6)))
        env[flow.output] = out
    return env


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


def reference_segment(layer: Layer, segment, values: dict[str, np.ndarray],
                      weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What one planned segment computes, from its bindings and epilogues (float64).

    ``segment`` is a :class:`~stofc.plan.plan.Segment` or a ``SegmentMatch``: the
    same description the kernels and the runner execute. Returns
    ``{output name: value}`` (the pre-norm value too when the segment stores it).
    """
    def act(slot: str):
        return np.asarray(values[segment.binding(slot)], np.float64)

    def param(slot: str):
        name = segment.binding(slot)
        return None if name is None else np.asarray(weights[name], np.float64).reshape(-1)

    def kn(slot: str) -> np.ndarray:
        name = segment.binding(slot)
        op = next(o for o in layer.chain if o.kind == OpKind.GEMM and o.param("weight") == name)
        return weight_kn(layer, op.index, weights).astype(np.float64)

    ep = segment.epilogues[-1]
    extra = {"residual": act("residual") if ep.residual else None, "gamma": param("gamma"),
             "beta": param("beta"), "eps": segment.epsilon}
    if segment.family in ("gemm", "gemm_norm"):
        out, pre = apply_epilogue(act("x") @ kn("w0"), ep, bias=param("b0"), **extra)
    elif segment.family == "gemm_gemm":
        hidden, _ = apply_epilogue(act("x") @ kn("w0"), segment.epilogues[0], bias=param("b0"))
        out, pre = apply_epilogue(hidden @ kn("w1"), ep, bias=param("b1"), **extra)
    elif segment.family == "add_norm":
        out, pre = apply_epilogue(act("x"), ep, bias=param("bias"), **extra)
    else:
        raise ValueError(f"no reference for family {segment.family!r}")
    result = {segment.binding("out"): out}
    if segment.binding("pre_norm_out"):
        result[segment.binding("pre_norm_out")] = pre
    return result
