"""Downstream kernel families on the GPU vs the float64 reference (see downstream_cases).

Shapes: BERT-base (768/3072), BERT-large (1024/4096), GPT-2 (768, pre-LN, tanh
GELU), ViT-base (768/3072, pre-LN, erf GELU), T5-small (512/2048, RMSNorm, no
bias, ReLU); token counts 128, 4096 and 32768 (subsampled across families to fit
the time budget), plus token counts that are not a multiple of any tile. Each
case checks every value its segments store, on fresh random inputs with
poisoned outputs, against ``2 r u + sqrt(K) 2^-22`` (module docstring).
"""

from __future__ import annotations

import pytest

from stofc.plan.moves import initial_scheme
from stofc.plan.scheme import FusionScheme
from stofc.plan.synthetic import bert_layer, gpt2_layer, synthetic_layer, t5_layer
from tests.gpu.downstream_cases import check_chain, make_plan

LAYERS = {
    "bert-base": lambda: bert_layer(768, 12, 3072),
    "bert-large": lambda: bert_layer(1024, 16, 4096),
    "gpt2": lambda: gpt2_layer(768, 12, 3072),
    "vit-base": lambda: synthetic_layer(hidden=768, heads=12, ffn=3072, norm_order="pre",
                                        gelu="none", epsilon=1e-6),
    "t5": lambda: t5_layer(512, 8, 2048),
}


def _scheme(layer, kind: str, tokens: int) -> FusionScheme:
    n = len(layer.chain)
    if kind == "fused":      # gemm (+bias/act/residual) and gemm_norm
        return initial_scheme(layer, tokens=max(tokens, 4096))
    if kind == "ffn_chain":  # gemm_gemm for the FFN (off in the default rules since run 3)
        return initial_scheme(layer, tokens=1, ffn_chain_max_tokens=64)
    if kind == "unfused":    # every op alone: plain gemm + one add_norm per MI op
        return FusionScheme.unfused(n)
    if kind == "split":      # gemm+bias(+act) then add_norm (residual + norm)
        starts = [i for i, op in enumerate(layer.chain)
                  if op.kind.value in ("gemm", "attention", "residual_add")
                  or (i > 0 and layer.chain[i - 1].kind.value == "attention")]
        return FusionScheme.unfused(n).with_boundaries(starts)
    raise ValueError(kind)


CASES = [
    # (layer, scheme, vendor (False | True: cuBLASLt folding | "nolt"), store, batch,
    #  seq_len, dtype)
    ("bert-base", "fused", False, "row", 1, 128, "float16"),
    ("bert-base", "fused", False, "heads", 8, 512, "float16"),
    ("bert-base", "fused", False, "row", 16, 2048, "float16"),
    ("bert-base", "fused", True, "row", 8, 512, "float16"),
    ("bert-base", "fused", False, "row", 4, 1024, "bfloat16"),
    ("bert-base", "split", False, "row", 8, 512, "float16"),
    ("bert-base", "unfused", False, "row", 1, 128, "bfloat16"),
    ("bert-base", "ffn_chain", False, "row", 1, 128, "float16"),
    ("bert-base", "ffn_chain", False, "row", 3, 37, "bfloat16"),
    ("bert-base", "fused", False, "heads", 3, 37, "float16"),
    ("bert-large", "fused", False, "row", 1, 128, "float16"),
    ("bert-large", "fused", False, "row", 8, 512, "bfloat16"),
    ("bert-large", "fused", True, "row", 16, 2048, "float16"),
    ("bert-large", "ffn_chain", False, "row", 1, 128, "float16"),
    ("bert-base", "ffn_chain", False, "row", 4, 1024, "float16"),
    ("gpt2", "fused", False, "row", 4, 1024, "float16"),
    ("gpt2", "fused", True, "row", 1, 128, "bfloat16"),
    ("gpt2", "split", False, "row", 32, 1024, "float16"),
    ("gpt2", "ffn_chain", False, "row", 1, 128, "float16"),
    ("gpt2", "ffn_chain", False, "row", 8, 512, "bfloat16"),
    ("vit-base", "ffn_chain", False, "row", 1, 197, "float16"),
    ("vit-base", "fused", False, "row", 16, 197, "float16"),
    ("vit-base", "fused", True, "row", 8, 512, "float16"),
    ("t5", "fused", False, "row", 2, 64, "float16"),
    ("t5", "fused", True, "row", 4, 256, "float16"),
    ("bert-base", "fused", "nolt", "row", 4, 512, "float16"),
    ("gpt2", "fused", "nolt", "row", 2, 100, "bfloat16"),
    ("bert-base", "split", True, "row", 1, 128, "bfloat16"),
    ("t5", "unfused", False, "row", 8, 512, "bfloat16"),
    ("t5", "ffn_chain", False, "row", 1, 128, "bfloat16"),
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_chain_matches_float64_reference(case):
    name, kind, vendor, store, batch, seq_len, dtype = case
    layer = LAYERS[name]()
    tokens = batch * seq_len
    scheme = _scheme(layer, kind, tokens)
    plan = make_plan(layer, scheme, dtype=dtype, tokens=tokens, vendor=vendor, store=store)
    families = {s.family for s in plan.segments}
    expected = {"fused": {"gemm_norm"} if name != "t5" else {"gemm"},
                "ffn_chain": {"gemm_gemm"}, "unfused": {"add_norm"},
                "split": {"add_norm"}}[kind]
    assert expected <= families, (kind, families)
    errors = check_chain(layer, plan, batch=batch, seq_len=seq_len, dtype=dtype,
                         seed=hash(case) % 2**31)
    assert errors, "no value was checked"
    print(case, {k.split("/")[-1]: f"{v:.2e}" for k, v in errors.items()})
