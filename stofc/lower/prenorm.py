"""bfloat16 packages: the sum a LayerNorm normalises is never rounded to bfloat16.

Why: a bf16 package used to write the pre-LN sum ``h = x@W + b + residual`` in
bf16 (FusedGemm, residual as cuBLASLt's C) and normalise that. Rounding ``h`` at
the residual stream's magnitude just before the norm cost 3.8 to 4.3e-3 of the
example's 1e-2 bound per site (bench/results/bf16-error-budget-cpu-2026-11-22.md);
with LayerNorm's gamma/beta also kept float32 (:func:`stofc.lower.emit.norm_param`)
the emulated end-to-end error falls from 1.09e-2 to 8.2e-3.

Contract of :func:`keep_pre_norm_fp32` (a pass over the emitted ai.stofc nodes,
before the Casts back to the original types): for each ``FusedGemm`` G whose
result is read by exactly one node, an ``AddLayerNorm`` N as its input ``x``,
and by nothing outside the fused ops, where G applies no activation and exactly
one of G and N has a residual:

* G computes ``x@w + bias`` in float32 (OPS.md: FusedGemm with a float32 bias
  writes a float32 ``y``; cuBLASLt with Atype = Btype = bf16, Ctype = Dtype =
  fp32, CUBLAS_COMPUTE_32F): its bias becomes the float32 original (zeros when
  the model had none: the float bias is what selects the float output), its
  residual input is dropped, and its result is a new float value.
* N reads that float value as ``x`` and the residual (G's, moved; or its own),
  so ``h = x + residual`` is formed in float32 in the norm (OPS.md: AddLayerNorm
  with a float ``x``).

The math is the same sum, only its rounding moves: the residual is added once
in float32 instead of being rounded into ``h``. Nothing else changes: float16
packages are never touched (their graph and kernels stay as they are), and a
GEMM whose result is read anywhere else keeps its bf16 form. Returns the
emitted segments with a ``note`` on those whose nodes changed.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
from onnx import helper, numpy_helper

from stofc.lower.emit import DOMAIN, EmittedSegment, Emitter

NOTE = ("pre-LN sum kept float32: {gemm} writes x@W+b in float32 (float32 bias, no residual) "
        "and {norm} adds the residual in float32 (bf16 package)")


def _attr_text(node: onnx.NodeProto, name: str, default: str) -> str:
    for a in node.attribute:
        if a.name == name:
            value = helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else str(value)
    return default


def _bias_f32(em: Emitter, gemm: onnx.NodeProto) -> str | None:
    """G's bias as a float32 initializer (from the model's original), zeros when absent."""
    bias = gemm.input[2] if len(gemm.input) > 2 else ""
    suffix = f"::stofc_{em.tag}"
    if bias:
        if not bias.endswith(suffix) or em.idx.const(bias[:-len(suffix)]) is None:
            return None                    # not a plain converted initializer (e.g. packed)
        return em.weight_f32(bias[:-len(suffix)])
    w = em.inits.get(gemm.input[1])
    if w is None or len(w.dims) != 2:
        return None
    name = f"{gemm.name}/zero_bias::stofc_f32"
    em.inits[name] = numpy_helper.from_array(np.zeros(int(w.dims[1]), np.float32), name)
    return name


def keep_pre_norm_fp32(em: Emitter, emitted: list[EmittedSegment], needed: set[str]
                       ) -> list[EmittedSegment]:
    """Rewrite each eligible FusedGemm -> AddLayerNorm pair of a bf16 package (module doc).

    ``needed`` holds the original values read outside the fused ops (unfused
    nodes, graph outputs): a GEMM result among them keeps its form.
    """
    if em.dtype != "bfloat16":
        return emitted
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in em.nodes:
        for name in node.input:
            if name:
                readers.setdefault(name, []).append(node)
    read_outside = {twin for value, twin in em.fused.items() if value in needed}
    notes: dict[str, str] = {}
    for gemm in [n for n in em.nodes if n.domain == DOMAIN and n.op_type == "FusedGemm"]:
        y = gemm.output[0]
        users = readers.get(y, [])
        if len(users) != 1 or y in read_outside or _attr_text(gemm, "activation", "none") != "none":
            continue
        norm = users[0]
        if norm.domain != DOMAIN or norm.op_type != "AddLayerNorm" or norm.input[0] != y \
                or list(norm.input).count(y) != 1:
            continue
        g_res = gemm.input[3] if len(gemm.input) > 3 else ""
        n_res = norm.input[1] if len(norm.input) > 1 else ""
        if bool(g_res) == bool(n_res):     # none (float x would be ambiguous) or two residuals
            continue
        bias = _bias_f32(em, gemm)
        if bias is None:
            continue
        y32 = f"{y}::f32"
        gemm.input[:] = [gemm.input[0], gemm.input[1], bias]
        gemm.output[0] = y32
        norm.input[0] = y32
        if g_res:
            norm.input[1] = g_res
        for value in [v for v, twin in em.fused.items() if twin == y]:
            del em.fused[value]
        notes[gemm.name] = notes[norm.name] = NOTE.format(gemm=gemm.name, norm=norm.name)
    if not notes:
        return emitted
    out = []
    for e in emitted:
        extra = list(dict.fromkeys(notes[n] for n in e.nodes if n in notes))
        if extra:
            e = replace(e, note="; ".join([e.note, *extra] if e.note else extra))
        out.append(e)
    return out
