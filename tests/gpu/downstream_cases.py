"""Shared GPU-check machinery for the downstream families (tests and bench).

``check_chain`` runs a layer's non-attention segments through the CuPy runner
(attention replaced by a fixed random tensor, so every remaining operator is
row-wise) and compares every value a segment stores with the float64
reference of the ONNX operators, on a random subset of rows when the token
count is large (all rows are still checked for being written: outputs are
poisoned with NaN first).

Error bound. Inputs and parameters are rounded to the storage dtype first and
the reference is computed from the rounded values, so the kernel's error is
(i) fp32 accumulation over K, at most about ``sqrt(K) * 2^-24`` relative
(random-sign rounding), and (ii) one rounding of each stored tensor to the
storage dtype, ``u = 2^-11`` (fp16) or ``2^-8`` (bf16) per element, i.e. about
``u / sqrt(3)`` in relative Frobenius norm, propagated with gain ~1 through
the later (1/sqrt(K)-scaled) GEMMs and norms. With ``r`` stored roundings on
the path to a value (its depth in the chain) the check is::

    ||out - ref||_F / ||ref||_F <= 2 * r * u + sqrt(K) * 2^-22

(the factor 2 covers the norm's division by the row's spread and the erf/tanh
evaluation; the sqrt(K) term is the fp32 accumulation with a margin of 4).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from stofc.frontend.types import OpKind
from stofc.plan.build import kernel_spec, plan_layer
from stofc.plan.dataflow import resolve_dataflow
from stofc.plan.families import match_segments
from stofc.plan.plan import LayerPlan
from stofc.plan.reference import reference_chain
from stofc.plan.synthetic import random_weights
from stofc.runtime.segments import SegmentRunner, from_bits, to_bits, to_device, to_host
from stofc.targets import get_profile

UNIT = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


def make_plan(layer, scheme, *, dtype, tokens, vendor=False, store="row") -> LayerPlan:
    profile = get_profile("h100")
    plan = plan_layer(layer, scheme, tokens=tokens, profile=profile, dtype=dtype,
                      qkv_store=store)
    if not vendor:
        return plan
    matches = {m.ordinal: m for m in match_segments(layer, scheme)}
    segs = []
    for seg in plan.segments:
        if seg.family in ("gemm", "gemm_norm", "gemm_glu") and \
                seg.kernel.param("store", "row") == "row":
            spec = kernel_spec(matches[seg.ordinal], tokens=tokens, profile=profile, dtype=dtype,
                               vendor=True)
            if vendor == "nolt":  # cuBLAS + the whole epilogue in the Add+Norm kernel
                spec = dataclasses.replace(spec, params=tuple(
                    (k, False if k == "lt" else v) for k, v in spec.params))
            seg = dataclasses.replace(seg, kernel=spec)
        segs.append(seg)
    return dataclasses.replace(plan, segments=tuple(segs))


def _depths(layer) -> dict[str, int]:
    """Stored roundings on the path to each value (inputs count 0)."""
    depth: dict[str, int] = {}
    for flow in resolve_dataflow(layer):
        depth[flow.output] = 1 + max((depth.get(v, 0) for v in flow.inputs), default=0)
    return depth


def _max_k(layer) -> int:
    return max(int(op.param("in_features")) for op in layer.chain if op.kind == OpKind.GEMM)


def check_chain(layer, plan: LayerPlan, *, batch: int, seq_len: int, dtype: str, seed: int,
                max_rows: int = 512) -> dict[str, float]:
    """Run ``plan`` on fresh random inputs; return rel. errors per stored value (asserts)."""
    import cupy

    rng = np.random.default_rng(seed)
    hidden = layer.attention.hidden_size
    m = batch * seq_len
    weights = {k: from_bits(to_bits(v, dtype), dtype)
               for k, v in random_weights(layer, rng).items()}
    runner = SegmentRunner(layer, plan, weights, dtype=dtype)
    runner.poison = True
    flows = resolve_dataflow(layer)
    x_name = flows[0].inputs[0]
    x = from_bits(to_bits(rng.standard_normal((m, hidden)), dtype), dtype)
    a = from_bits(to_bits(rng.standard_normal((m, hidden)), dtype), dtype)
    values = {x_name: to_device(x, dtype)}
    a_dev = to_device(a, dtype)
    runner.run_chain(values, batch=batch, seq_len=seq_len, attention=lambda seg, vals: a_dev)
    cupy.cuda.runtime.deviceSynchronize()

    rows = np.arange(m) if m <= max_rows else np.sort(rng.choice(m, max_rows, replace=False))
    ref = reference_chain(layer, {x_name: x[rows]}, weights, lambda ins: a[rows])
    depth = _depths(layer)
    errors: dict[str, float] = {}
    for seg in plan.segments:
        if seg.family == "attention":
            continue
        for name in seg.outputs:
            dev = values[name]
            got = to_host(dev, dtype)
            if got.ndim == 5:  # [G, B, H, S, D] -> [B*S, G*H*D]
                got = got.transpose(1, 3, 0, 2, 4).reshape(m, -1)
            assert np.isfinite(got).all(), f"{name}: unwritten (poisoned) or non-finite outputs"
            want = ref[name]
            diff = np.linalg.norm(got[rows] - want) / np.linalg.norm(want)
            bound = 2 * depth[name] * UNIT[dtype] + math.sqrt(_max_k(layer)) * 2.0**-22
            assert diff <= bound, (f"{name} ({seg.family}, {seg.kernel.template}): rel. error "
                                   f"{diff:.3e} > bound {bound:.3e}")
            errors[name] = float(diff)
    return errors
