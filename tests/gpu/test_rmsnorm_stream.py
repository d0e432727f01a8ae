"""The pre-norm RMSNorm residual stream of Llama-sized layers on the GPU (issue 15).

Llama-family layers (hidden 4096, no biases, RMSNorm, pre-norm order) at the small token
counts of decoding and short prompts: the lead RMSNorm alone (``add_norm``), the attention
residual folded into the output GEMM or run with the post-attention RMSNorm in one pass
(``add_norm``: x = x + attn; y = rmsnorm(x), storing x for the FFN's residual), in float16
and bfloat16. Every stored value is checked against the float64 reference with the bound
of :mod:`tests.gpu.downstream_cases`. (The synthetic FFN is not gated: the gated MLP is
left to ONNX Runtime in this wave.)
"""

from __future__ import annotations

import pytest

from stofc.plan.moves import initial_scheme
from stofc.plan.scheme import FusionScheme
from stofc.plan.synthetic import synthetic_layer
from tests.gpu.downstream_cases import check_chain, make_plan

HIDDEN, HEADS, FFN = 4096, 32, 11008


def _llama_layer():
    return synthetic_layer(hidden=HIDDEN, heads=HEADS, ffn=FFN, norm_order="pre",
                           norm="rmsnorm", bias=False, activation="relu", epsilon=1e-6)


def _scheme(layer, kind: str, tokens: int) -> FusionScheme:
    if kind == "split":  # every GEMM alone, each residual Add with the norm after it
        starts = [i for i, op in enumerate(layer.chain)
                  if op.kind.value in ("gemm", "attention", "residual_add")
                  or (i > 0 and layer.chain[i - 1].kind.value == "attention")]
        return FusionScheme.unfused(len(layer.chain)).with_boundaries(starts)
    return initial_scheme(layer, tokens=tokens)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("batch,seq_len", [(1, 1), (1, 16), (3, 37)])
@pytest.mark.parametrize("kind", ["split", "initial"])
def test_llama_rmsnorm_stream(kind, batch, seq_len, dtype):
    layer = _llama_layer()
    tokens = batch * seq_len
    plan = make_plan(layer, _scheme(layer, kind, tokens), dtype=dtype, tokens=tokens)
    norms = [s for s in plan.segments if s.epilogues and s.epilogues[-1].norm == "rmsnorm"]
    assert len(norms) == 2                       # the lead norm and the post-attention norm
    if kind == "split":
        fused = [s for s in norms if s.family == "add_norm" and s.epilogues[-1].residual]
        assert fused and fused[0].epilogues[-1].store_pre_norm  # x = x + attn, kept
    errors = check_chain(layer, plan, batch=batch, seq_len=seq_len, dtype=dtype, seed=7)
    assert errors
