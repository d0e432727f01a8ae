"""Gated FFNs on the GPU: the CuPy runner's ``gemm_glu`` executors vs the float64 reference.

Llama-like layers (pre-RMSNorm, no biases, SwiGLU) and GeGLU/ReGLU variants with biases,
at Llama-7B's FFN shape (hidden 4096, F 11008) and a small one, through both families of
the segment kind: ``vendor_glu`` (cuBLASLt with its BIAS epilogue, then the gated-activation
kernel; ``nolt``: plain cuBLAS, the kernel adding the bias) and the hand-written
``gemm_glu`` (mma.sync, the product in the epilogue, interleaved weights); and the gated
activation alone (``glu``) when a scheme splits it from its GEMM. Every value the
layer's segments store is checked with ``check_chain`` (``tests/gpu/downstream_cases.py``:
poisoned outputs, ``2 r u + sqrt(K) 2^-22`` relative Frobenius bound).
"""

from __future__ import annotations

import pytest

from stofc.kernels import catalog
from stofc.plan.moves import initial_scheme
from stofc.plan.scheme import FusionScheme
from stofc.plan.synthetic import llama_layer
from tests.gpu.downstream_cases import check_chain, make_plan

CASES = [
    # (hidden, heads, ffn, glu, bias, vendor, batch, seq_len, dtype)
    (512, 8, 1408, "silu", False, True, 2, 64, "float16"),
    (512, 8, 1408, "silu", False, False, 2, 64, "float16"),
    (512, 8, 1408, "silu", False, "nolt", 3, 37, "bfloat16"),
    (512, 8, 1408, "gelu_erf", True, True, 1, 128, "bfloat16"),
    (512, 8, 1408, "gelu_erf", True, False, 3, 37, "float16"),
    (512, 8, 1408, "gelu_tanh", True, "nolt", 4, 256, "float16"),
    (512, 8, 1408, "gelu_tanh", False, False, 1, 128, "bfloat16"),
    (512, 8, 1408, "relu", True, True, 2, 100, "float16"),
    (512, 8, 1408, "relu", False, False, 8, 512, "bfloat16"),
    (4096, 32, 11008, "silu", False, True, 1, 128, "bfloat16"),
    (4096, 32, 11008, "silu", False, True, 4, 1024, "float16"),
    (4096, 32, 11008, "silu", False, False, 1, 111, "float16"),
    (4096, 32, 11008, "gelu_tanh", False, False, 2, 512, "bfloat16"),
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_gated_chain_matches_float64_reference(case):
    hidden, heads, ffn, glu, bias, vendor, batch, seq_len, dtype = case
    layer = llama_layer(hidden=hidden, heads=heads, ffn=ffn, glu=glu, bias=bias)
    tokens = batch * seq_len
    plan = make_plan(layer, initial_scheme(layer, tokens=max(tokens, 4096)), dtype=dtype,
                     tokens=tokens, vendor=vendor)
    (seg,) = [s for s in plan.segments if s.family == "gemm_glu"]
    assert catalog.family_of(seg.kernel).name == ("vendor_glu" if vendor else "gemm_glu")
    assert seg.kernel.param("lt", True) == (vendor is True) or not vendor
    errors = check_chain(layer, plan, batch=batch, seq_len=seq_len, dtype=dtype,
                         seed=hash(case) % 2**31)
    assert seg.binding("out") in errors
    print(case, {k.split("/")[-1]: f"{v:.2e}" for k, v in errors.items()})


@pytest.mark.parametrize("bias,dtype", [(True, "float16"), (False, "bfloat16")])
def test_split_gated_activation_matches_float64_reference(bias, dtype):
    """Every operator its own segment: the gated activation alone (family ``glu``, the
    gated-activation kernel adding the bias when the scheme gives it one) after a plain
    GEMM of the packed projection."""
    layer = llama_layer(hidden=512, heads=8, ffn=1408, glu="gelu_tanh", bias=bias)
    plan = make_plan(layer, FusionScheme.unfused(len(layer.chain)), dtype=dtype, tokens=300)
    assert "glu" in {s.family for s in plan.segments}
    errors = check_chain(layer, plan, batch=3, seq_len=100, dtype=dtype, seed=7)
    assert errors
