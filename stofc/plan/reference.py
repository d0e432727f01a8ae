"""Float64 references of a layer chain and of one planned segment (ONNX semantics).

:func:`reference_ops` evaluates chain operators one by one (the numeric pieces are
:mod:`stofc.kernels.reference`'s); :func:`reference_chain` runs a whole chain with the
attention supplied by the caller; :func:`reference_segment` computes what one
planned segment computes from its bindings and epilogues, through the segment
kind's kernel family (every family of a kind computes the same function). GPU
tests and the tuner's verification compare fused kernels against these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from stofc.frontend.types import Layer, OpKind
from stofc.kernels import catalog
from stofc.kernels.reference import gated, gelu, layernorm, rmsnorm
from stofc.plan.dataflow import resolve_dataflow


def weight_kn(layer: Layer, op_index: int, weights: dict[str, np.ndarray]) -> np.ndarray:
    """A GEMM's weight in [K, N] (MatMul) layout, whatever the model stored."""
    op = layer.chain[op_index]
    w = np.asarray(weights[op.param("weight")])
    return w if op.param("weight_layout", "KN") == "KN" else w.T


def reference_ops(layer: Layer, ops: Iterable[int], env: dict[str, np.ndarray],
                  weights: dict[str, np.ndarray],
                  attention: Callable[[list[np.ndarray]], np.ndarray] | None = None
                  ) -> dict[str, np.ndarray]:
    """Evaluate the chain operators ``ops`` in order into ``env`` (float64, updated and
    returned); their inputs must be in ``env``. ``attention`` computes the attention
    operator from the projection results (a ValueError without it)."""
    flows = resolve_dataflow(layer)
    for i in ops:
        flow, op = flows[i], layer.chain[i]
        ins = [env[v] for v in flow.inputs]
        if op.kind == OpKind.GEMM:
            out = ins[0] @ weight_kn(layer, i, weights).astype(np.float64)
        elif op.kind == OpKind.BIAS_ADD:
            out = ins[0] + weights[op.param("bias")]
        elif op.kind == OpKind.ATTENTION and attention is not None:
            out = np.asarray(attention(ins), np.float64)
        elif op.kind == OpKind.RESIDUAL_ADD:
            out = ins[0] + ins[1]
        elif op.kind == OpKind.GELU:
            tanh = op.param("approximation") == "tanh" or op.param("form") in ("tanh", "fastgelu")
            out = gelu(ins[0], "tanh" if tanh else "none")
        elif op.kind == OpKind.ACTIVATION:
            out = np.maximum(ins[0], 0.0)
        elif op.kind == OpKind.GATED:
            out = gated(ins[0], str(op.param("act")))
        elif op.kind == OpKind.LAYERNORM:
            beta = op.param("bias")
            out = layernorm(ins[0], weights[op.param("scale")],
                            weights[beta] if beta is not None else None,
                            float(op.param("epsilon", 1e-5)))
        elif op.kind == OpKind.RMSNORM:
            out = rmsnorm(ins[0], weights[op.param("scale")], float(op.param("epsilon", 1e-6)))
        else:
            raise ValueError(f"operator {op.kind.value} has no reference here")
        env[flow.output] = out
    return env


def reference_chain(layer: Layer, values: dict[str, np.ndarray], weights: dict[str, np.ndarray],
                    attention: Callable[[list[np.ndarray]], np.ndarray]) -> dict[str, np.ndarray]:
    """Evaluate ``layer.chain`` in float64; ``values`` must hold the layer input.

    Activations are 2-D ``[tokens, features]``. ``attention`` receives the
    projection results and returns the attention output. Returns every value.
    """
    env = {k: np.asarray(v, np.float64) for k, v in values.items()}
    return reference_ops(layer, range(len(layer.chain)), env, weights, attention)


def reference_segment(layer: Layer, segment: Any, values: dict[str, np.ndarray],
                      weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What one planned segment computes, from its bindings and epilogues (float64).

    ``segment`` is a :class:`~stofc.plan.plan.Segment` or a ``SegmentMatch``: the
    same description the kernels and the runner execute. Returns
    ``{output name: value}`` (the pre-norm value too when the segment stores it).
    """
    def act(slot: str) -> np.ndarray:
        return np.asarray(values[segment.binding(slot)], np.float64)

    def param(slot: str) -> np.ndarray | None:
        name = segment.binding(slot)
        return None if name is None else np.asarray(weights[name], np.float64).reshape(-1)

    def kn(slot: str) -> np.ndarray:
        name = segment.binding(slot)
        op = next(o for o in layer.chain if o.kind == OpKind.GEMM and o.param("weight") == name)
        return weight_kn(layer, op.index, weights).astype(np.float64)

    ep = segment.epilogues[-1]
    extra = {"residual": act("residual") if ep.residual else None, "gamma": param("gamma"),
             "beta": param("beta"), "eps": segment.epsilon}
    out, pre = catalog.segment_kind(segment.family).reference(segment, act, param, kn, extra)
    result = {segment.binding("out"): out}
    if segment.binding("pre_norm_out"):
        result[segment.binding("pre_norm_out")] = pre
    return result
