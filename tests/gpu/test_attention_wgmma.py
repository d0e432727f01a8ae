"""GPU correctness of the Hopper wgmma block-wise kernel against a float64 reference.

Skipped on GPUs other than sm_90 (wgmma is sm_90a only). The same cases as the
mma.sync kernel's: every MASKS.md family, gathered and permuted walks, both
dtypes and head_dims 64/128, tiles 64/128 with and without the query split,
padding by lengths and 0/1 masks, bias, layouts, packed QKV and empty rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from stofc.kernels.attention import AttentionConfig, prune, search_space
from stofc.kernels.attention.reference import format_from_dense
from stofc.targets import detect
from tests.gpu.test_attention import FAMILIES, _seed, check_padding_bias_layouts
from tests.gpu.test_attention_helpers import TOL, encoded, run_case


def _hopper() -> bool:
    try:
        return detect().compute_capability == (9, 0)
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _hopper(), reason="wgmma needs an sm_90 GPU")

WG = AttentionConfig("block", 64, 16, 4, 2, 1, mma="wgmma")
WG_GATHER = AttentionConfig("block", 64, 16, 4, 2, 1, gather=True, mma="wgmma")
WG_PERMUTE = AttentionConfig("block", 64, 16, 4, 2, 1, gather=True, permute=True, mma="wgmma")
WG_T128 = AttentionConfig("block", 128, 16, 8, 2, 1, mma="wgmma")
WG_T128_SPLIT = AttentionConfig("block", 128, 16, 4, 3, 2, mma="wgmma")
KINDS = {"wg": WG, "gather": WG_GATHER, "permute": WG_PERMUTE}


def _check(res, dtype, what=""):
    assert not res.nan, f"NaN in the output {what}"
    assert res.err <= TOL[dtype], f"relative error {res.err:.2e} > {TOL[dtype]} {what}"


@pytest.mark.parametrize("kind", ["wg", "gather"])
@pytest.mark.parametrize("spec", FAMILIES)
def test_every_family(spec, kind):
    fmt, dense = encoded(spec, 1000)
    res = run_case(fmt, dense, KINDS[kind], batch=2, heads=3, seq=1000, head_dim=64,
                   seed=_seed("wg", spec, kind))
    _check(res, "float16", spec)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("cfg", [WG, WG_T128, WG_T128_SPLIT], ids=["t64", "t128", "t128q2"])
def test_head_dims_dtypes_tiles(cfg, head_dim, dtype):
    if head_dim == 256 and cfg.tile == 128:   # K/V tiles of 128 x 256 do not fit twice
        assert "shared memory" in prune(cfg, head_dim, detect())
        return
    fmt, dense = encoded("longformer:window=100,global=20", 450, tile=cfg.tile)
    res = run_case(fmt, dense, cfg, batch=2, heads=2, seq=450, head_dim=head_dim, dtype=dtype,
                   seed=_seed("wgdims", cfg, head_dim, dtype))
    _check(res, dtype, f"{cfg.describe()} D={head_dim}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["wg", "gather", "permute"])
def test_padding_bias_layouts(kind, dtype):
    check_padding_bias_layouts(KINDS[kind], kind, dtype, _seed("wgpad", kind, dtype))


def test_empty_rows_give_zeros():
    dense = np.zeros((300, 300), dtype=bool)
    dense[100:200, :50] = True                   # rows outside 100..199 have no key
    dense[250:, 250:] = np.tril(np.ones((50, 50), dtype=bool))
    fmt = format_from_dense(dense, 64)
    res = run_case(fmt, dense, WG, batch=2, heads=2, seq=300, head_dim=64, seed=_seed("wgempty"))
    _check(res, "float16")
    assert np.all(res.out[:, :100] == 0.0) and np.all(res.out[:, 200:250] == 0.0)


@pytest.mark.parametrize("tile", [64, 128])
def test_every_wgmma_config_of_the_search_space(tile):
    fmt, dense = encoded("bigbird:block=32,window=3,global=1,random=2,seed=1", 600, tile=tile)
    configs = [c for c in search_space("block", 64, "float16", detect(), tile=tile)
               if c.mma == "wgmma"]
    assert configs, "the sm_90 search space must hold wgmma configs"
    for cfg in configs:
        res = run_case(fmt, dense, cfg, batch=2, heads=2, seq=600, head_dim=64,
                       seed=_seed("wgspace", tile, cfg))
        _check(res, "float16", cfg.describe())


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("kind", ["wg", "gather"])
def test_grouped_query_attention(kind, kv_heads):
    fmt, dense = encoded("sliding:window=150,causal=true", 500)
    res = run_case(fmt, dense, KINDS[kind], batch=2, heads=6, seq=500, head_dim=128,
                   dtype="bfloat16", kv_heads=kv_heads, packed=kv_heads == 2,
                   seq_lens=[500, 431], seed=_seed("wggqa", kind, kv_heads))
    _check(res, "bfloat16")


@pytest.mark.parametrize("head_dim", [128, 256])
def test_logit_softcap(head_dim):
    fmt, dense = encoded("longformer:window=64,global=8", 300)
    key_mask = np.ones((2, 300), np.int32)
    key_mask[1, 225:] = 0
    res = run_case(fmt, dense, WG, batch=2, heads=2, seq=300, head_dim=head_dim,
                   dtype="bfloat16", softcap=20.0, score_scale=8.0, key_mask=key_mask,
                   bias_shape=(1, 2, 300, 300), seed=_seed("wgcap", head_dim))
    _check(res, "bfloat16")
